"""A LLaVA request through the engine: greedy tokens equal transformers' generate, and the
prefix cache keys image blocks by the image (same image: hit; different image: miss)."""

from __future__ import annotations

import pytest
import torch

from services.api.sampling import SamplingParams
from services.common.config import EngineConfig
from services.common.hashing import ImageKey, block_hashes
from services.engine.engine import LLMEngine
from services.engine.multimodal.vision_tower import ImageEncoder
from services.engine.multimodal.weights import load_llava_dir
from services.engine.request import GenerateRequest
from services.engine.runner.torch_runner import TorchRunner
from services.engine.scheduler import InvalidRequestError
from services.model.image_spans import ImageSpan, expand_placeholders
from tests.support.tiny_llava import IMAGE_TOKEN, save_tiny_llava, tiny_llava

BS = 4


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    hf = tiny_llava("clip", "llama")
    w = load_llava_dir(save_tiny_llava(hf, tmp_path_factory.mktemp("llava")))
    enc = ImageEncoder(w.arch)
    enc.load_hf_weights(w.vision, w.projector)
    return hf, w, enc


def _engine(w) -> LLMEngine:
    cfg = EngineConfig(device="cpu", dtype="float32", block_size=BS, num_kv_blocks=128, max_num_batched_tokens=64,
                       overlap=False)
    return LLMEngine(TorchRunner(w.text.arch, w.text.tensors, cfg), cfg, [])


def _pixels(seed: int) -> torch.Tensor:
    return torch.randn(1, 3, 56, 56, generator=torch.Generator().manual_seed(seed))


def _request(rid, w, enc, short, pixels, name):
    full, spans = expand_placeholders(short, IMAGE_TOKEN, w.arch.tokens_per_image, [name * 64])
    spans = tuple(s.with_embeds(enc(pixels)[0]) for s in spans)
    return GenerateRequest(rid, full, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), images=spans)


def _run(engine: LLMEngine, request: GenerateRequest):
    engine.add_request(request)
    tokens, cached = [], None
    while engine.has_unfinished():
        for out in engine.step():
            tokens.extend(out.token_ids)
            if out.finished:
                cached = out.num_cached_tokens
    return tokens, cached


def test_greedy_tokens_equal_transformers_generate(llava):
    hf, w, enc = llava
    short = [3, 4, 5, IMAGE_TOKEN, 9, 10, 11]
    req = _request("a", w, enc, short, _pixels(1), "a")
    tokens, _ = _run(_engine(w), req)
    with torch.no_grad():
        want = hf.generate(input_ids=torch.tensor([req.prompt_token_ids]), pixel_values=_pixels(1),
                           max_new_tokens=6, do_sample=False)[0, len(req.prompt_token_ids):].tolist()
    assert tokens == want


def test_same_image_hits_the_prefix_cache_a_different_one_does_not(llava):
    _, w, enc = llava
    engine = _engine(w)
    short = [3, 4, 5, 6, IMAGE_TOKEN, 9, 10, 11, 12, 13]  # image at position 4 (block 1)
    n = len(short) - 1 + w.arch.tokens_per_image
    _run(engine, _request("a", w, enc, short, _pixels(1), "a"))
    _, same = _run(engine, _request("b", w, enc, short, _pixels(1), "a"))
    _, other = _run(engine, _request("c", w, enc, short, _pixels(2), "c"))
    assert same == (n - 1) // BS * BS  # everything but the last (partial) block
    assert other == BS  # only the text block before the image


def test_image_keys_change_only_the_blocks_they_overlap():
    tokens = list(range(12))
    a = block_hashes(tokens, 4, images=[ImageKey(5, 2, "ab" * 32)])
    b = block_hashes(tokens, 4, images=[ImageKey(5, 2, "cd" * 32)])
    moved = block_hashes(tokens, 4, images=[ImageKey(4, 2, "ab" * 32)])
    plain = block_hashes(tokens, 4)
    assert a[0] == b[0] == plain[0]
    assert a[1].local_hash != b[1].local_hash and a[1].local_hash != moved[1].local_hash
    assert a[2].local_hash == b[2].local_hash and a[2].seq_hash != b[2].seq_hash  # chained


def test_engine_refuses_images_without_embeddings_or_outside_the_prompt(llava):
    _, w, _ = llava
    engine = _engine(w)
    bad = GenerateRequest("x", [1, 2, 3], SamplingParams(max_tokens=2), images=(ImageSpan(1, 2, "a" * 64),))
    with pytest.raises(InvalidRequestError, match="no embeddings"):
        engine.validate(bad)
    far = GenerateRequest("y", [1, 2, 3], images=(ImageSpan(2, 4, "a" * 64, torch.zeros(4, 64)),))
    with pytest.raises(InvalidRequestError, match="outside the prompt"):
        engine.validate(far)


def test_n_choices_with_an_image_each_equal_the_single_answer(llava):
    """n=2 greedy: the forked choice recomputes the prompt's tail (image tokens included
    when they fall there) and answers like the single request."""
    import dataclasses

    _, w, enc = llava
    short = [3, 4, 5, 6, 7, IMAGE_TOKEN, 9]  # the image near the end: inside the recomputed tail
    req = _request("a", w, enc, short, _pixels(2), "b")
    single, _ = _run(_engine(w), req)
    engine = _engine(w)
    engine.add_request(dataclasses.replace(req, request_id="m",
                                           sampling=dataclasses.replace(req.sampling, n=2)))
    got: dict[int, list[int]] = {0: [], 1: []}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.index].extend(out.token_ids)
    assert got == {0: single, 1: single}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_greedy_tokens_equal_transformers_generate_on_cuda(llava):
    """The vision tower, projector and language model on CUDA (float32, overlap and CUDA
    graphs as `auto` picks them) give transformers' greedy tokens."""
    hf, w, _ = llava
    enc = ImageEncoder(w.arch, device="cuda")
    enc.load_hf_weights(w.vision, w.projector)
    cfg = EngineConfig(device="cuda", dtype="float32", block_size=BS, num_kv_blocks=128,
                       max_num_batched_tokens=64)
    engine = LLMEngine(TorchRunner(w.text.arch, w.text.tensors, cfg), cfg, [])
    short = [3, 4, 5, IMAGE_TOKEN, 9, 10, 11, IMAGE_TOKEN, 12]
    full, spans = expand_placeholders(short, IMAGE_TOKEN, w.arch.tokens_per_image, ["a" * 64, "b" * 64])
    pixels = [_pixels(1), _pixels(2)]
    spans = tuple(s.with_embeds(enc(p.cuda())[0]) for s, p in zip(spans, pixels, strict=True))
    req = GenerateRequest("a", full, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), images=spans)
    tokens, _ = _run(engine, req)
    with torch.no_grad():
        want = hf.generate(input_ids=torch.tensor([full]), pixel_values=torch.cat(pixels),
                           max_new_tokens=6, do_sample=False)[0, len(full):].tolist()
    assert tokens == want
    assert engine.stats().kv_blocks_used == 0


def test_deterministic_mode_serves_an_image_chunk_beside_a_decode(llava):
    """engine.deterministic on the CPU kernels: a step holding image rows takes the eager
    forward with the chunks' own masks (not the one-call rows), so an image prompt
    prefilled in chunks beside a decoding text request gives the greedy tokens it gives
    without the mode."""
    from services.engine.cpu_kernels import build
    from services.engine.cpu_kernels import isa as isas

    if not any(build.available(i) for i in isas.ISAS):
        pytest.skip("no CPU kernel set can run here")
    _, w, enc = llava

    def tokens(deterministic: bool) -> dict[str, list[int]]:
        cfg = EngineConfig(device="cpu", dtype="bfloat16", quantization="int4", block_size=BS, num_kv_blocks=128,
                           max_num_batched_tokens=8, overlap=False, deterministic=deterministic)
        engine = LLMEngine(TorchRunner(w.text.arch, w.text.tensors, cfg), cfg, [])
        engine.add_request(GenerateRequest("t", [3, 4, 5, 6], SamplingParams(temperature=0.0, max_tokens=12,
                                                                             ignore_eos=True)))
        engine.step()  # the text request is decoding before the image prompt arrives
        engine.add_request(_request("i", w, enc, [3, 4, 5, IMAGE_TOKEN, 9, 10, 11], _pixels(2), "b"))
        got: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for out in engine.step():
                got.setdefault(out.request_id, []).extend(out.token_ids)
        return got

    det, eager = tokens(True), tokens(False)
    assert len(det["i"]) == 6 and len(det["t"]) >= 11
    assert det == eager
