"""Our AVX-512 CPU kernels (services/engine/cpu_kernels/): the int4 matmul against the
dequantized weights, the one-call decode step against the eager forward on the same int4
weights, and how the runner turns them on. Skips where the kernels cannot run (no
AVX512-BF16, no g++)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from services.common.config import EngineConfig
from services.engine.cpu_kernels import build, pack
from services.engine.cpu_kernels.decode import CpuDecode
from services.engine.quant.groups import Int4Groups, from_float
from services.engine.runner.torch_runner import TorchRunner
from tests.support.tiny_model import batch, seq, tiny_hf_model

pytestmark = pytest.mark.skipif(not build.available(), reason="the CPU kernels cannot run here")


def _reference(x: torch.Tensor, groups: Int4Groups) -> torch.Tensor:
    return x.double() @ groups.dequantize().double().T


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 17])
@pytest.mark.parametrize("out_features", [16, 40, 200])
def test_int4_linear_equals_the_dequantized_weight(rows: int, out_features: int) -> None:
    torch.manual_seed(rows * 1000 + out_features)
    groups = from_float(torch.randn(out_features, 96))
    codes, scale_min = pack.pack(groups)
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    got = torch.ops.tandem_cpu.int4_linear(x, codes, scale_min, out_features)
    assert got.shape == (rows, out_features) and got.dtype == torch.bfloat16
    want = _reference(x, groups)
    # float32 sums, then one bfloat16 rounding of the output
    torch.testing.assert_close(got.double(), want, rtol=8e-3, atol=1e-2 * want.abs().max().item())


def test_int4_linear_reads_the_input_cyclically_for_repeated_groups() -> None:
    """A Q8_0 weight as two nibble halves (input_repeat 2): both halves read the same x."""
    torch.manual_seed(1)
    hi, lo = from_float(torch.randn(24, 64)), from_float(torch.randn(24, 64))
    both = Int4Groups(torch.cat([hi.codes, lo.codes], 1), torch.cat([hi.scale, lo.scale], 1),
                      torch.cat([hi.zero, lo.zero], 1), 32, input_repeat=2)
    codes, scale_min = pack.pack(both)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    got = torch.ops.tandem_cpu.int4_linear(x, codes, scale_min, 24).double()
    want = _reference(x, hi) + _reference(x, lo)
    torch.testing.assert_close(got, want, rtol=8e-3, atol=1e-2 * want.abs().max().item())


def test_int4_linear_refuses_mismatched_shapes() -> None:
    codes, scale_min = pack.pack(from_float(torch.randn(16, 64)))
    with pytest.raises(RuntimeError, match="do not fill"):
        torch.ops.tandem_cpu.int4_linear(torch.zeros(1, 64, dtype=torch.bfloat16), codes, scale_min, 40)
    with pytest.raises(RuntimeError, match="do not repeat"):
        torch.ops.tandem_cpu.int4_linear(torch.zeros(1, 96, dtype=torch.bfloat16), codes, scale_min, 16)


def test_int4_linear_from_several_threads_at_once() -> None:
    """One thread at a time holds the helper pool; the others run their loop alone, and
    every result is still right."""
    groups = from_float(torch.randn(512, 64, generator=torch.Generator().manual_seed(2)))
    codes, scale_min = pack.pack(groups)
    xs = [torch.randn(2, 64, dtype=torch.bfloat16) for _ in range(4)]
    want = [torch.ops.tandem_cpu.int4_linear(x, codes, scale_min, 512) for x in xs]
    errors: list[str] = []

    def hammer(i: int) -> None:
        for _ in range(200):
            if not torch.equal(torch.ops.tandem_cpu.int4_linear(xs[i], codes, scale_min, 512), want[i]):
                errors.append(f"thread {i}")
                return

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def _runners(architecture: str, **cfg) -> dict[str, TorchRunner]:
    model, arch = tiny_hf_model(architecture)
    tensors = model.state_dict()
    # quantized_max_rows None: every step on the int4 weights (no dense copy for batches of
    # more than 16 rows), as the one-call decode step always is
    base = dict(device="cpu", quantization="int4", quantized_max_rows=None, block_size=4, num_kv_blocks=256, **cfg)
    return {
        # the same int4 weights three ways: float32 activations as the reference, then
        # bfloat16 on the eager forward and on the kernels
        "reference": TorchRunner(arch, tensors, EngineConfig(dtype="float32", cpu_kernels=False, **base)),
        "eager": TorchRunner(arch, tensors, EngineConfig(dtype="bfloat16", cpu_kernels=False, **base)),
        "kernels": TorchRunner(arch, tensors, EngineConfig(dtype="bfloat16", cpu_kernels=True, **base)),
    }


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_decode_step_matches_the_eager_forward(architecture: str) -> None:
    """Twenty sequences of different lengths (several KV blocks each, one mid-block) decode
    four steps together: every step's logits stay as close to the float32 reference as
    the eager bfloat16 forward's do, and the greedy tokens agree."""
    runners = _runners(architecture)
    assert runners["kernels"].model.cpu_decode is not None
    assert runners["eager"].model.cpu_decode is None
    n = 20
    prompts = [[(7 * i + 3 * j) % 128 for j in range(3 + 2 * i)] for i in range(n)]
    blocks = [list(range(12 * i, 12 * i + 12)) for i in range(n)]  # 48 slots each
    tokens = {name: [p[-1] for p in prompts] for name in runners}
    for r in runners.values():
        r.execute(batch(*[seq(f"s{i}", p[:-1], 0, blocks[i]) for i, p in enumerate(prompts)]))
    agree = total = 0
    for step in range(4):
        logits = {}
        for name, r in runners.items():
            b = batch(*[seq(f"s{i}", [tokens[name][i]], len(p) - 1 + step, blocks[i]) for i, p in enumerate(prompts)])
            logits[name] = r.logits_for(b)
        ref = logits["reference"]
        err = {name: (logits[name] - ref).abs().max().item() for name in ("eager", "kernels")}
        assert err["kernels"] <= 1.5 * err["eager"] + 0.05, err
        agree += int((logits["kernels"].argmax(-1) == ref.argmax(-1)).sum())
        total += n
        # every runner continues from the reference's tokens, so the contexts stay equal
        for name in runners:
            tokens[name] = ref.argmax(-1).tolist()
    assert agree >= 0.9 * total


def test_decode_step_writes_the_same_kv_as_the_eager_forward() -> None:
    runners = _runners("llama")
    kernels, eager = runners["kernels"], runners["eager"]
    for r in (kernels, eager):
        r.execute(batch(seq("a", [5, 6, 7, 8, 9], 0, [0, 1])))
        r.execute(batch(seq("a", [10], 5, [0, 1])))
    # the decode token's K/V at slot 5 (block 1, offset 1), every layer
    got, want = kernels.kv_cache[:, :, 1, 1].float(), eager.kv_cache[:, :, 1, 1].float()
    assert got.abs().max() > 0
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.05)


def test_mixed_steps_still_take_the_eager_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step with a prefill chunk is not decode-only: the eager forward runs it (on the
    int4 kernel for its few rows), and the next decode-only step takes the one call."""
    r = _runners("llama")["kernels"]
    calls: list[int] = []
    real = CpuDecode.__call__

    def spy(self, input_ids, *rest):
        calls.append(input_ids.shape[0])
        return real(self, input_ids, *rest)

    monkeypatch.setattr(CpuDecode, "__call__", spy)
    r.execute(batch(seq("a", [1, 2, 3], 0, [0]), seq("b", [4], 0, [1])))
    assert calls == []
    r.execute(batch(seq("a", [9], 3, [0]), seq("b", [9], 1, [1])))
    assert calls == [2]


def test_decode_forward_refuses_bad_rows() -> None:
    r = _runners("llama")["kernels"]
    r.execute(batch(seq("a", [1, 2, 3], 0, [0])))
    with pytest.raises(RuntimeError, match="token id"):
        r.execute(batch(seq("a", [500], 3, [0])))


def test_cpu_kernels_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    model, arch = tiny_hf_model("llama")
    tensors = model.state_dict()
    off = TorchRunner(arch, tensors, EngineConfig(device="cpu", dtype="bfloat16", quantization="int4", cpu_kernels=False))
    assert off.model.cpu_decode is None and not off.model.layers[0].qkv_proj.matmul.kernel
    on = TorchRunner(arch, tensors, EngineConfig(device="cpu", dtype="bfloat16", quantization="int4"))  # auto
    assert on.model.cpu_decode is not None and on.model.layers[0].qkv_proj.matmul.kernel
    # engine.overlap auto: on beside the one-call step, off beside the eager forward
    assert on.overlap_pays and not off.overlap_pays
    fp32 = TorchRunner(arch, tensors, EngineConfig(device="cpu", dtype="float32", quantization="int4"))
    assert fp32.model.cpu_decode is None  # auto: bfloat16 only
    with pytest.raises(ValueError, match="cpu_kernels: true"):
        TorchRunner(arch, tensors, EngineConfig(device="cpu", dtype="float32", quantization="int4", cpu_kernels=True))

    def unavailable() -> None:
        raise build.KernelUnavailable("the CPU lacks avx512_bf16")

    monkeypatch.setattr(build, "load", unavailable)
    monkeypatch.setattr(build, "available", lambda: False)
    with pytest.raises(ValueError, match="lacks avx512_bf16"):
        TorchRunner(arch, tensors, EngineConfig(device="cpu", dtype="bfloat16", quantization="int4", cpu_kernels=True))
    fallback = TorchRunner(arch, tensors, EngineConfig(device="cpu", dtype="bfloat16", quantization="int4"))
    assert fallback.model.cpu_decode is None and not fallback.model.layers[0].qkv_proj.matmul.kernel


def test_library_is_built_once_per_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh cache directory builds the library; the file name keys the source, torch
    and the flags, so an edited kernel cannot load a stale build."""
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    path = build._library_path()
    assert path.parent == tmp_path / "kernels" and path.name.startswith("tandem_cpu-")
    assert build.main() == 0
    assert path.exists() and list(path.parent.iterdir()) == [path]  # no temporary file left
    mtime = path.stat().st_mtime_ns
    assert build.main() == 0 and path.stat().st_mtime_ns == mtime  # built once
