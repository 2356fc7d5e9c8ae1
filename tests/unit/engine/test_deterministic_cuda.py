"""engine.deterministic on CUDA: the batch-invariant Triton kernels (layers/invariant.py).

A row's bits from each kernel must not depend on how many rows share the call or where the
row sits; a token's logits must be the same alone, chunked, beside others and from a CUDA
graph; a seeded request's text the same at batch sizes 1, 7 and 64. Skips without CUDA.

The text test runs on the real SmolLM2 where it is pulled. A GPU host without it (the
lent machines take no file that large) can point ``TANDEM_TEST_CUDA_MODEL`` at a Hugging
Face directory of the same shape (random weights make near-ties everywhere: a stricter
test of the bits, a meaningless one of the text).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from services.common.config import EngineConfig
from services.engine.layers.attention import build_attention_metadata, paged_attention
from services.engine.runner.torch_runner import TorchRunner
from tests.support.batch_invariance import (
    BLOCKS,
    OTHER_BLOCKS,
    OTHERS,
    alone_chunked_mixed,
    seeded_texts,
)
from tests.support.tiny_model import batch, seq, tiny_hf_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def inv():
    from services.engine.layers import invariant

    return invariant


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_linear_rows_bits_do_not_depend_on_the_row_count_or_place(inv, dtype: torch.dtype) -> None:
    w = torch.randn(1536, 576, dtype=dtype, device=CUDA) * 0.05
    rows = torch.randn(300, 576, dtype=dtype, device=CUDA)
    whole = inv.linear(rows, w)
    assert _rel(whole, rows.double() @ w.double().T) < (1e-2 if dtype == torch.bfloat16 else 1e-5)
    for start, n in [(0, 1), (5, 7), (70, 64), (299, 1), (1, 299)]:
        part = inv.linear(rows[start:start + n].clone(), w)
        assert torch.equal(part, whole[start:start + n]), (start, n)


def test_an_rms_norm_rows_bits_do_not_depend_on_the_row_count(inv) -> None:
    x = torch.randn(200, 576, dtype=torch.bfloat16, device=CUDA)
    weight = torch.randn(576, dtype=torch.bfloat16, device=CUDA)
    whole = inv.rms_norm(x, weight, 1e-5)
    ref = torch.nn.functional.rms_norm(x.double(), (576,), weight.double(), 1e-5)
    assert _rel(whole, ref) < 1e-2
    for start, n in [(0, 1), (3, 7), (100, 64)]:
        assert torch.equal(inv.rms_norm(x[start:start + n].clone(), weight, 1e-5), whole[start:start + n])


def _attention_case(per_token: bool, prefills, decodes, q, k, v, cache, kernel):
    meta = build_attention_metadata(prefills, decodes, 4, CUDA, q.dtype, per_token=per_token)
    c = cache.clone()
    return kernel(q, k, v, c, meta), c


def test_token_attention_equals_paged_attention_and_a_tokens_bits_its_context_alone(inv) -> None:
    torch.manual_seed(0)
    hq, hkv, hd = 9, 3, 64
    cache = torch.randn(2, 96, 4, hkv, hd, dtype=torch.bfloat16, device=CUDA)
    # a fresh prompt, a chunk continuing at position 5, three decodes (one at position 0)
    prefills = [(0, list(range(0, 8)), 9), (5, list(range(8, 16)), 6)]
    decodes = [(3, list(range(16, 20))), (10, list(range(20, 24))), (0, [30])]
    t = 9 + 6 + 3
    q, k, v = (torch.randn(t, h, hd, dtype=torch.bfloat16, device=CUDA) for h in (hq, hkv, hkv))
    ref, ref_cache = _attention_case(False, prefills, decodes, q, k, v, cache, paged_attention)
    got, got_cache = _attention_case(True, prefills, decodes, q, k, v, cache, inv.invariant_attention)
    assert torch.equal(got_cache, ref_cache)
    assert _rel(got, ref) < 1e-2
    # the decode at position 10 alone: its cache now holds what the step wrote
    alone, _ = _attention_case(True, [], [decodes[1]], q[16:17], k[16:17], v[16:17], got_cache,
                               inv.invariant_attention)
    assert torch.equal(alone, got[16:17])
    # the continuing chunk's last token as a one-token chunk of its own
    alone, _ = _attention_case(True, [(10, list(range(8, 16)), 1)], [], q[14:15], k[14:15], v[14:15],
                               got_cache, inv.invariant_attention)
    assert torch.equal(alone, got[14:15])


def test_token_attention_past_one_split_keeps_a_rows_bits(inv) -> None:
    """Contexts of 256 to 701 keys (one to three splits): within bfloat16 rounding of
    paged_attention, and a row's output alone equals its output in the batch."""
    torch.manual_seed(1)
    hq, hkv, hd, bs = 9, 3, 64, 16
    cache = torch.randn(2, 200, bs, hkv, hd, dtype=torch.bfloat16, device=CUDA)
    prefills = [(500, list(range(0, 40)), 12)]
    decodes = [(700, list(range(40, 90))), (255, list(range(90, 110))), (256, list(range(110, 130))), (3, [130])]
    q, k, v = (torch.randn(16, h, hd, dtype=torch.bfloat16, device=CUDA) for h in (hq, hkv, hkv))

    def run(pre, dec, per_token, kernel, rows, c0):
        meta = build_attention_metadata(pre, dec, bs, CUDA, torch.bfloat16, per_token=per_token)
        c = c0.clone()
        return kernel(q[rows], k[rows], v[rows], c, meta), c

    ref, _ = run(prefills, decodes, False, paged_attention, slice(0, 16), cache)
    got, written = run(prefills, decodes, True, inv.invariant_attention, slice(0, 16), cache)
    assert _rel(got, ref) < 1e-2
    alone, _ = run([], [decodes[0]], True, inv.invariant_attention, slice(12, 13), written)
    assert torch.equal(alone, got[12:13])
    alone, _ = run([(511, list(range(0, 40)), 1)], [], True, inv.invariant_attention, slice(11, 12), written)
    assert torch.equal(alone, got[11:12])


def _runner(**cfg) -> TorchRunner:
    model, arch = tiny_hf_model("llama")
    base = dict(device="cuda", dtype="bfloat16", block_size=4, num_kv_blocks=256, max_num_seqs=16,
                cuda_graph_max_context=128, deterministic=True)
    return TorchRunner(arch, model.state_dict(), EngineConfig(**{**base, **cfg}))


def _alone_chunked_mixed(**cfg) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The shared three ways of the prompt's last logits, then its next token decoded beside
    the six others (a CUDA graph where on) against the same token decoded alone."""
    got = alone_chunked_mixed(lambda: _runner(**cfg))
    want_next = got.alone_runner.logits_for(batch(seq("p", [7], 23, BLOCKS)))
    b = [seq(f"o{i}", [2], len(o) + 1, OTHER_BLOCKS[i]) for i, o in enumerate(OTHERS)]
    got_next = got.mixed_runner.logits_for(batch(*b[:3], seq("p", [7], 23, BLOCKS), *b[3:]))[3:4]
    assert torch.equal(want_next, got.alone_runner.logits_for(batch(seq("p", [7], 23, BLOCKS))))  # a replay of itself
    return got.want, got.chunked, got.mixed, torch.stack([want_next, got_next])


@pytest.mark.parametrize("graphs", [False, True])
def test_a_tokens_logits_are_the_same_bits_alone_chunked_and_beside_others(graphs: bool) -> None:
    want, chunked, mixed, (want_next, got_next) = _alone_chunked_mixed(cuda_graphs=graphs)
    assert torch.equal(chunked, want)
    assert torch.equal(mixed, want)
    assert torch.equal(got_next, want_next)


def test_graphs_replay_the_invariant_decode() -> None:
    r = _runner(cuda_graphs=True)
    assert r.graphs is not None and r.graphs.per_token
    r.execute(batch(seq("p", [3, 4, 5], 0, [0, 1])))
    before = r.graphs.replays
    r.execute(batch(seq("p", [6], 3, [0, 1])))
    assert r.graphs.replays == before + 1


def test_deterministic_logits_match_a_float32_forward_within_bfloat16_rounding() -> None:
    prompts = [[(7 * i + 3 * j) % 128 for j in range(5 + 4 * i)] for i in range(5)]
    blocks = [list(range(12 * i, 12 * i + 12)) for i in range(5)]
    b = batch(*[seq(f"s{i}", p, 0, blocks[i]) for i, p in enumerate(prompts)])
    ref = _runner(dtype="float32", deterministic=False, cuda_graphs=False).logits_for(b)
    eager = _runner(deterministic=False, cuda_graphs=False).logits_for(b)
    det = _runner(cuda_graphs=False).logits_for(b)
    err_eager, err_det = (eager - ref).abs().max().item(), (det - ref).abs().max().item()
    assert err_det <= 1.5 * err_eager + 0.05, (err_det, err_eager)
    assert (det.argmax(-1) == ref.argmax(-1)).all()
    det32 = _runner(dtype="float32", cuda_graphs=False).logits_for(b)
    torch.testing.assert_close(det32, ref, rtol=1e-4, atol=1e-4)


def test_the_mode_on_cuda_refuses_quantized_weights() -> None:
    with pytest.raises(ValueError, match="engine.deterministic"):
        _runner(quantization="int8")


@pytest.fixture(scope="module")
def text_model(request: pytest.FixtureRequest) -> Path:
    given = os.environ.get("TANDEM_TEST_CUDA_MODEL")
    return Path(given) if given else request.getfixturevalue("smollm2_path")


def test_seeded_and_greedy_text_is_the_same_at_batch_sizes_1_7_and_64(text_model: Path) -> None:
    det, model = {"device": "cuda", "deterministic": True}, str(text_model)
    alone = seeded_texts(det, 1, model=model)
    assert len(alone) == 16
    assert seeded_texts(det, 7, model=model) == alone
    assert seeded_texts({**det, "max_num_batched_tokens": 32}, 64, model=model) == alone  # chunked prefills in mixed steps
    assert seeded_texts({**det, "overlap": False, "cuda_graphs": False}, 7, repeat=True, model=model) == alone  # cache hits
