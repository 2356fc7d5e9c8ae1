"""engine.deterministic: every step through the CPU kernels' one-call step, each new token
its own row. A token's logits are the same bits alone or beside others, chunked or whole,
from the cache or computed; a seeded request's text the same at batch sizes 1, 7 and 64.
Without the mode the eager forward's attention and norms sum in a shape-dependent order:
a control test shows the logits then differ, so these tests would see a difference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.api.sampling import SamplingParams
from services.common.config import EngineConfig
from services.engine.cpu_kernels import build
from services.engine.cpu_kernels import isa as isas
from services.engine.runner import torch_runner
from services.engine.runner.torch_runner import TorchRunner
from tests.support.batch_invariance import alone_chunked_mixed, seeded_texts
from tests.support.tiny_model import batch, seq, tiny_hf_model

RUNNABLE = [i for i in isas.ISAS if build.available(i)]
pytestmark = pytest.mark.skipif(not RUNNABLE, reason="no CPU kernel set can run here")
SEEDED = SamplingParams(max_tokens=1, temperature=1.0, seed=1)


def _tiny_runner(**cfg) -> TorchRunner:
    model, arch = tiny_hf_model("llama")
    base = dict(device="cpu", dtype="bfloat16", quantization="int4", quantized_max_rows=None, block_size=4,
                num_kv_blocks=256, cpu_kernels=True)
    return TorchRunner(arch, model.state_dict(), EngineConfig(**{**base, **cfg}))


def _alone_chunked_mixed(**cfg) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    got = alone_chunked_mixed(lambda: _tiny_runner(**cfg))
    return got.want, got.chunked, got.mixed


def test_a_tokens_logits_are_the_same_bits_alone_chunked_and_beside_others() -> None:
    want, chunked, mixed = _alone_chunked_mixed(deterministic=True)
    assert torch.equal(chunked, want)
    assert torch.equal(mixed, want)


def test_the_mode_never_takes_a_dense_copy_for_many_rows() -> None:
    """engine.quantized_max_rows sends batches of more rows to a dense GEMM (the default on
    CPUs with native bfloat16); the mode keeps every row on the kernels, so the logits of a
    row sampled among four equal its logits alone."""
    prompts = [[(5 * i + 7 * j) % 128 for j in range(6 + i)] for i in range(4)]
    blocks = [list(range(8 * i, 8 * i + 8)) for i in range(4)]
    alone = _tiny_runner(deterministic=True, quantized_max_rows=1).logits_for(batch(seq("s0", prompts[0], 0, blocks[0])))
    many = _tiny_runner(deterministic=True, quantized_max_rows=1).logits_for(
        batch(*[seq(f"s{i}", p, 0, blocks[i]) for i, p in enumerate(prompts)]))
    assert torch.equal(many[0:1], alone)


def test_without_the_mode_they_are_not(monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: off the mode (steps with prefill on the eager forward, not the one call
    that small chunks take by default) the same three differ in their last bits, so the
    test above would see a difference where there is one."""
    monkeypatch.setattr(torch_runner, "ONE_CALL_PREFILL_TOKENS", 0)
    monkeypatch.setattr(torch_runner, "ROWS_PREFILL_SETS", frozenset())  # engine.cpu_prefill auto: eager
    want, chunked, mixed = _alone_chunked_mixed()
    assert not torch.equal(chunked, want) or not torch.equal(mixed, want)
    torch.testing.assert_close(chunked, want, rtol=0.05, atol=0.05)


def test_deterministic_logits_match_the_eager_forward_within_rounding() -> None:
    """The one-call step over prefill rows computes the same model: its logits stay as
    close to a float32 reference as the eager bfloat16 forward's."""
    prompts = [[(7 * i + 3 * j) % 128 for j in range(5 + 4 * i)] for i in range(5)]
    blocks = [list(range(12 * i, 12 * i + 12)) for i in range(5)]
    b = batch(*[seq(f"s{i}", p, 0, blocks[i]) for i, p in enumerate(prompts)])
    ref = _tiny_runner(dtype="float32", cpu_kernels=False).logits_for(b)
    eager = _tiny_runner().logits_for(b)
    det = _tiny_runner(deterministic=True).logits_for(b)
    err_eager, err_det = (eager - ref).abs().max().item(), (det - ref).abs().max().item()
    assert err_det <= 1.5 * err_eager + 0.05, (err_det, err_eager)
    assert (det.argmax(-1) == ref.argmax(-1)).all()


def test_deterministic_mode_refuses_a_runner_off_the_kernels() -> None:
    with pytest.raises(ValueError, match="engine.deterministic"):
        _tiny_runner(dtype="float32", quantization="none", cpu_kernels=False, deterministic=True)


@pytest.fixture(scope="module")
def smollm2(smollm2_path: Path) -> Path:
    return smollm2_path


def test_seeded_and_greedy_text_is_the_same_at_batch_sizes_1_7_and_64(smollm2: Path) -> None:
    det = {"deterministic": True}
    alone = seeded_texts(det, 1)
    assert len(alone) == 16
    assert seeded_texts(det, 7) == alone
    assert seeded_texts({**det, "max_num_batched_tokens": 32}, 64) == alone  # chunked prefills in mixed steps
    assert seeded_texts({**det, "overlap": False}, 7, repeat=True) == alone  # cache hits, serial loop
