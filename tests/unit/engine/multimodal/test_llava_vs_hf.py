"""Our LLaVA (vision tower + projector + paged Llama/Qwen2) reproduces transformers' logits."""

from __future__ import annotations

import hashlib

import pytest
import torch

from services.engine.multimodal.vision_tower import ImageEncoder
from services.engine.multimodal.weights import load_llava_dir
from services.model.image_spans import expand_placeholders
from tests.support.tiny_llava import IMAGE_TOKEN, image_prompt, save_tiny_llava, tiny_llava
from tests.support.tiny_model import batch, make_runner, seq

TOL = 1e-4
CASES = [
    ("clip", "llama", -2, "default"),
    ("siglip", "qwen2", -1, "full"),
    ("clip", "qwen2", [-3, -1], "default"),
    ("siglip", "llama", -2, "default"),
]


@pytest.fixture(scope="module", params=CASES, ids=["-".join(map(str, c)) for c in CASES])
def setup(request, tmp_path_factory):
    vision, text, layer, strategy = request.param
    hf = tiny_llava(vision, text, layer, strategy)
    path = save_tiny_llava(hf, tmp_path_factory.mktemp("llava"))
    w = load_llava_dir(path)
    encoder = ImageEncoder(w.arch)
    encoder.load_hf_weights(w.vision, w.projector)
    runner = make_runner(w.text.arch, w.text.tensors, num_kv_blocks=128)
    return hf, w.arch, encoder, runner


def _pixels(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, 3, 56, 56, generator=torch.Generator().manual_seed(seed))


def _spans(arch, encoder, short: list[int], pixels: torch.Tensor):
    hashes = [hashlib.sha256(p.numpy().tobytes()).hexdigest() for p in pixels]
    full, spans = expand_placeholders(short, IMAGE_TOKEN, arch.tokens_per_image, hashes)
    embeds = encoder(pixels) if len(pixels) else None
    return full, tuple(s.with_embeds(embeds[i]) for i, s in enumerate(spans))


def _hf_logits(hf, full: list[int], pixels: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = hf(input_ids=torch.tensor([full]), pixel_values=pixels if len(pixels) else None)
    return out.logits[0].float()


@pytest.mark.parametrize("n_images", [0, 1, 2])
def test_prefill_logits_match(setup, n_images):
    hf, arch, encoder, runner = setup
    short, _ = image_prompt(12, n_images, seed=n_images, tokens_per_image=arch.tokens_per_image)
    pixels = _pixels(n_images, seed=10 + n_images)
    full, spans = _spans(arch, encoder, short, pixels)
    want = _hf_logits(hf, full, pixels)
    blocks = list(range(40, 40 + (len(full) + 3) // 4))
    got = runner.logits_for(batch(seq("a", full, 0, blocks) if not spans else _with_images(full, 0, blocks, spans)))
    assert (got - want[-1:]).abs().max().item() < TOL


def test_chunks_cutting_images_then_decode(setup):
    """Chunk borders inside an image take the right embedding rows; decoding after the
    images reads their KV."""
    hf, arch, encoder, runner = setup
    short, _ = image_prompt(10, 2, seed=7, tokens_per_image=arch.tokens_per_image)
    pixels = _pixels(2, seed=8)
    full, spans = _spans(arch, encoder, short, pixels)
    blocks = list(range(64, 64 + (len(full) + 16) // 4))
    want = _hf_logits(hf, full, pixels)
    cuts = [0, spans[0].offset + 3, spans[1].offset + 1, len(full) - 2, len(full)]
    for lo, hi in zip(cuts, cuts[1:], strict=False):
        got = runner.logits_for(batch(_with_images(full[lo:hi], lo, blocks, spans)))
        assert (got - want[hi - 1 : hi]).abs().max().item() < TOL, (lo, hi)
    tokens = list(full)
    for _ in range(3):
        nxt = int(_hf_logits(hf, tokens, pixels)[-1].argmax())
        tokens.append(nxt)
        got = runner.logits_for(batch(_with_images([nxt], len(tokens) - 1, blocks, spans)))
        assert (got - _hf_logits(hf, tokens, pixels)[-1:]).abs().max().item() < TOL


def test_image_embeddings_change_the_logits(setup):
    """Guards the comparison: a different image gives different logits."""
    _, arch, encoder, runner = setup
    short, _ = image_prompt(8, 1, seed=3, tokens_per_image=arch.tokens_per_image)
    full, a = _spans(arch, encoder, short, _pixels(1, 1))
    _, b = _spans(arch, encoder, short, _pixels(1, 2))
    blocks = list(range(100, 100 + (len(full) + 3) // 4))
    la = runner.logits_for(batch(_with_images(full, 0, blocks, a)))
    lb = runner.logits_for(batch(_with_images(full, 0, blocks, b)))
    assert (la - lb).abs().max().item() > 1e-2


def _with_images(tokens, start, blocks, spans):
    s = seq("a", tokens, start, blocks)
    s.images = spans
    return s
