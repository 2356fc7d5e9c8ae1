"""Our CPU kernels (services/engine/cpu_kernels/), once per instruction set the CPU can run
(the others skip): the int4 matmul against the dequantized weights, the one-call decode
step against the eager forward on the same int4 weights, and how the runner turns them on.

The int8 paths (avx512_vnni, avx512, avx2) quantize each row's activations to int8 per
32-wide group: they match, tightly, a reference that quantizes the same way, and the
float reference within that rounding (an int8 step is 1/254 of a group's largest input)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from services.common.config import EngineConfig
from services.engine.batch import ScheduledBatch
from services.engine.cpu_kernels import build
from services.engine.cpu_kernels import isa as isas
from services.engine.cpu_kernels.cpu_features import cpuinfo_flags
from services.engine.cpu_kernels.isa import KernelSet
from services.engine.quant import pack
from services.engine.quant.groups import QuantSource, from_float
from services.engine.quant.linear import QuantizedLinear
from services.engine.runner import torch_runner
from services.engine.runner.cpu_decode import ONE_CALL_PREFILL_TOKENS, ROWS_PREFILL_SETS, CpuDecode
from services.engine.runner.torch_runner import TorchRunner
from tests.support.int4_reference import check, gguf_groups
from tests.support.tiny_model import batch, seq, tiny_hf_model

RUNNABLE = [i for i in isas.ISAS if build.available(i)]
pytestmark = pytest.mark.skipif(not RUNNABLE, reason="no CPU kernel set can run here")


def _each_isa() -> list:
    return [pytest.param(i, marks=pytest.mark.skipif(i not in RUNNABLE, reason=f"the CPU cannot run {i}"))
            for i in isas.ISAS]


EACH_ISA = pytest.mark.parametrize("isa", _each_isa())


def _ops(isa: str):
    return getattr(torch.ops, build.load(isa).namespace)


@EACH_ISA
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 17])
@pytest.mark.parametrize("out_features", [16, 40, 200])
def test_int4_linear_equals_the_dequantized_weight(isa: str, dtype: torch.dtype, rows: int, out_features: int) -> None:
    ks = build.load(isa)
    if dtype == torch.float32 and not ks.float_input:
        pytest.skip(f"{isa} takes bfloat16 activations only")
    torch.manual_seed(rows * 1000 + out_features)
    groups = from_float(torch.randn(out_features, 96))
    codes, scale_min = pack.pack(groups, ks.layout)
    x = torch.randn(rows, 96, dtype=dtype)
    got = _ops(isa).int4_linear(x, codes, scale_min, out_features)
    assert got.shape == (rows, out_features) and got.dtype == dtype
    check(isa, got, x, groups)


@EACH_ISA
@pytest.mark.parametrize("source", ["Q4_0", "Q4_1", "Q8_0"])
def test_int4_linear_on_gguf_groupings(isa: str, source: str) -> None:
    """GGUF's exact groupings (quant/groups.py): Q4_0 (zero 0), Q4_1 (a min a block) and
    Q8_0 (two nibble halves, input_repeat 2: both read the same x), over 130 rows (a
    partial tile) and an input of 576 (18 groups), as SmolLM2's."""
    gen = torch.Generator().manual_seed(7)
    n, k = 130, 576
    groups = gguf_groups(source, n, k, gen)
    ks = build.load(isa)
    codes, scale_min = pack.pack(groups, ks.layout)
    x = torch.randn(9, k, generator=gen).to(torch.bfloat16)
    check(isa, _ops(isa).int4_linear(x, codes, scale_min, n), x, groups)


@EACH_ISA
@pytest.mark.parametrize("out_features", [1040, 1036])
def test_int4_linear_of_a_large_output_equals_small_calls(isa: str, out_features: int) -> None:
    """An output of 2 MiB or more (520 x 1040 float32) is written past the cache in whole
    lines; 1036 has a part tile (and a row width that cannot stream). Each output is
    computed the same way whatever the call's size, so the large call equals 8-row calls
    bit for bit."""
    ks = build.load(isa)
    dtype = torch.float32 if ks.float_input else torch.bfloat16
    gen = torch.Generator().manual_seed(out_features)
    groups = from_float(torch.randn(out_features, 64, generator=gen))
    codes, scale_min = pack.pack(groups, ks.layout)
    x = torch.randn(520, 64, generator=gen).to(dtype)
    whole = _ops(isa).int4_linear(x, codes, scale_min, out_features)
    parts = torch.cat([_ops(isa).int4_linear(x[i:i + 8], codes, scale_min, out_features) for i in range(0, 520, 8)])
    assert torch.equal(whole, parts)
    check(isa, whole, x, groups)


@EACH_ISA
def test_int4_linear_refuses_mismatched_shapes(isa: str) -> None:
    ops, ks = _ops(isa), build.load(isa)
    codes, scale_min = pack.pack(from_float(torch.randn(16, 64)), ks.layout)
    with pytest.raises(RuntimeError, match="do not fill"):
        ops.int4_linear(torch.zeros(1, 64, dtype=torch.bfloat16), codes, scale_min, 40)
    with pytest.raises(RuntimeError, match="do not repeat"):
        ops.int4_linear(torch.zeros(1, 96, dtype=torch.bfloat16), codes, scale_min, 16)
    with pytest.raises(RuntimeError, match="x: contiguous"):
        ops.int4_linear(torch.zeros(1, 64, dtype=torch.float16), codes, scale_min, 16)


@EACH_ISA
def test_int4_linear_from_several_threads_at_once(isa: str) -> None:
    """One thread at a time holds the helper pool; the others run their loop alone, and
    every result is still right."""
    ops, ks = _ops(isa), build.load(isa)
    groups = from_float(torch.randn(512, 64, generator=torch.Generator().manual_seed(2)))
    codes, scale_min = pack.pack(groups, ks.layout)
    xs = [torch.randn(2, 64, dtype=torch.bfloat16) for _ in range(4)]
    want = [ops.int4_linear(x, codes, scale_min, 512) for x in xs]
    errors: list[str] = []

    def hammer(i: int) -> None:
        for _ in range(200):
            if not torch.equal(ops.int4_linear(xs[i], codes, scale_min, 512), want[i]):
                errors.append(f"thread {i}")
                return

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def _runners(architecture: str, isa: str, **cfg) -> dict[str, TorchRunner]:
    model, arch = tiny_hf_model(architecture)
    tensors = model.state_dict()
    # quantized_max_rows None: every step on the int4 weights (no dense copy for batches of
    # more than 16 rows), as the one-call decode step always is
    base = dict(device="cpu", quantization="int4", quantized_max_rows=None, block_size=4, num_kv_blocks=256, **cfg)
    return {
        # the same int4 weights three ways: float32 activations on torch's kernels as the
        # reference, then bfloat16 on the eager forward and on the kernels' one-call step
        "reference": TorchRunner(arch, tensors, EngineConfig(dtype="float32", cpu_kernels=False, **base)),
        "eager": _eager(arch, tensors, isa, base),
        "kernels": TorchRunner(arch, tensors, EngineConfig(dtype="bfloat16", cpu_kernels=True, cpu_isa=isa, **base)),
    }


def _eager(arch, tensors: dict, isa: str, base: dict, **kw) -> TorchRunner:
    """The eager bfloat16 forward the one-call step must be as close as: on torch's int4
    kernels for avx512_bf16 (no activation rounding either way); on the int8 paths, on the
    same set's matmuls (the same int8 rounding of every matmul input), one-call step off."""
    if not build.load(isa).float_input:
        return TorchRunner(arch, tensors, EngineConfig(dtype="bfloat16", cpu_kernels=False, **base), **kw)
    r = TorchRunner(arch, tensors, EngineConfig(dtype="bfloat16", cpu_kernels=True, cpu_isa=isa, **base), **kw)
    r.model.cpu_decode = None
    return r


def _decode_four_steps(runners: dict[str, TorchRunner], prompts: list[list[int]], slack: float) -> tuple[int, int, int]:
    """Every sequence decodes four steps together: every step's logits stay as close to the
    reference as the eager bfloat16 forward's do (within ``slack``). Returns how many rows'
    greedy tokens agree with the reference's, eager and kernels, and of how many."""
    n = len(prompts)
    blocks = [list(range(12 * i, 12 * i + 12)) for i in range(n)]  # 48 slots each
    tokens = {name: [p[-1] for p in prompts] for name in runners}
    for r in runners.values():
        r.execute(batch(*[seq(f"s{i}", p[:-1], 0, blocks[i]) for i, p in enumerate(prompts)]))
    agree = eager_agree = total = 0
    for step in range(4):
        logits = {}
        for name, r in runners.items():
            b = batch(*[seq(f"s{i}", [tokens[name][i]], len(p) - 1 + step, blocks[i]) for i, p in enumerate(prompts)])
            logits[name] = r.logits_for(b)
        ref = logits["reference"]
        err = {name: (logits[name] - ref).abs().max().item() for name in ("eager", "kernels")}
        assert err["kernels"] <= 1.5 * err["eager"] + slack, err
        agree += int((logits["kernels"].argmax(-1) == ref.argmax(-1)).sum())
        eager_agree += int((logits["eager"].argmax(-1) == ref.argmax(-1)).sum())
        total += n
        # every runner continues from the reference's tokens, so the contexts stay equal
        for name in runners:
            tokens[name] = ref.argmax(-1).tolist()
    return eager_agree, agree, total


@EACH_ISA
@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_decode_step_matches_the_eager_forward(isa: str, architecture: str) -> None:
    """Twenty sequences of different lengths (several KV blocks each, one mid-block)."""
    runners = _runners(architecture, isa)
    assert runners["kernels"].model.cpu_decode is not None and runners["kernels"].info.cpu_isa == isa
    assert runners["eager"].model.cpu_decode is None
    prompts = [[(7 * i + 3 * j) % 128 for j in range(3 + 2 * i)] for i in range(20)]
    _, agree, total = _decode_four_steps(runners, prompts, slack=0.05)
    assert agree >= 0.9 * total


@EACH_ISA
def test_a_rows_decode_does_not_depend_on_the_rows_beside_it(isa: str) -> None:
    """The attention cuts a lone row by the threads it has (tiny model: 4 query heads over
    2 KV heads): at one thread one task of every head, at two one task a KV head, at four
    one a query head; beside 19 others each row is a task. The row's logits must be the
    same bits every way (deterministic mode relies on it)."""
    r = _runners("llama", isa)["kernels"]
    prompts = [[(7 * i + 3 * j) % 128 for j in range(17 + i)] for i in range(20)]  # 5-10 blocks
    blocks = [list(range(12 * i, 12 * i + 12)) for i in range(20)]
    r.execute(batch(*[seq(f"s{i}", p[:-1], 0, blocks[i]) for i, p in enumerate(prompts)]))
    threads = torch.get_num_threads()
    alone = {}
    try:
        for n in (1, 2, 4):
            torch.set_num_threads(n)
            alone[n] = r.logits_for(batch(seq("s0", [prompts[0][-1]], len(prompts[0]) - 1, blocks[0])))
        torch.set_num_threads(2)
        together = r.logits_for(batch(*[seq(f"s{i}", [p[-1]], len(p) - 1, blocks[i])
                                        for i, p in enumerate(prompts)]))
    finally:
        torch.set_num_threads(threads)
    for n, logits in alone.items():
        assert torch.equal(logits[0], together[0]), n
    # and the rows beside it differ from it (the batch is not one row copied)
    assert not torch.equal(together[0], together[1])


_REAL = dict(device="cpu", quantization="int4", quantized_max_rows=None, block_size=4, num_kv_blocks=256)


@pytest.fixture(scope="module")
def real_runners(smollm2_path: Path) -> tuple:
    """SmolLM2's weights and its float32 reference (built once for every set)."""
    from services.engine.weights import load_weights

    w = load_weights(smollm2_path)
    return w, {
        "reference": TorchRunner(w.arch, w.tensors, EngineConfig(dtype="float32", cpu_kernels=False, **_REAL),
                                 quant_source=w.quant),
    }


@EACH_ISA
def test_decode_step_on_the_real_model(isa: str, real_runners: tuple) -> None:
    """SmolLM2's Q4_1 weights, exact in every layout: the one-call step on ``isa`` against
    float32 activations on torch's int4 kernels, as close as the eager bfloat16 forward."""
    w, refs = real_runners
    kernels = TorchRunner(w.arch, w.tensors, EngineConfig(dtype="bfloat16", cpu_kernels=True, cpu_isa=isa, **_REAL),
                          quant_source=w.quant)
    assert kernels.model.cpu_decode is not None
    eager = _eager(w.arch, w.tensors, isa, _REAL, quant_source=w.quant)
    prompts = [[1 + (97 * i + 31 * j) % 20000 for j in range(5 + 3 * i)] for i in range(6)]
    eager_agree, agree, total = _decode_four_steps({**refs, "eager": eager, "kernels": kernels}, prompts, slack=0.5)
    # random-token prompts put a real model's top two logits within the int8 rounding on a
    # few rows (measured: 22/24 eager, 21/24 one-call on avx512_vnni): at most one more flip
    assert agree >= eager_agree - 1 and agree >= 0.8 * total, (eager_agree, agree, total)


@EACH_ISA
def test_decode_step_writes_the_same_kv_as_the_eager_forward(isa: str, monkeypatch: pytest.MonkeyPatch) -> None:
    runners = _runners("llama", isa)
    kernels, eager = runners["kernels"], runners["eager"]
    # both prefill on the eager forward (no small mixed step on the one call): only the
    # decode step differs between them
    monkeypatch.setattr(torch_runner, "ONE_CALL_PREFILL_TOKENS", 0)
    monkeypatch.setattr(kernels, "prefill_rows", False)
    for r in (kernels, eager):
        r.execute(batch(seq("a", [5, 6, 7, 8, 9], 0, [0, 1])))
        r.execute(batch(seq("a", [10], 5, [0, 1])))
    # the decode token's K/V at slot 5 (block 1, offset 1), every layer
    got, want = kernels.kv_cache[:, :, 1, 1].float(), eager.kv_cache[:, :, 1, 1].float()
    assert got.abs().max() > 0
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.05)


def _one_call_rows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The row count of every step that runs on the one call from now on, appended as it runs."""
    calls: list[int] = []
    real = CpuDecode.__call__

    def spy(self, input_ids, *rest):
        calls.append(input_ids.shape[0])
        return real(self, input_ids, *rest)

    monkeypatch.setattr(CpuDecode, "__call__", spy)
    return calls


def test_small_mixed_steps_take_the_one_call_and_large_ones_the_eager_forward(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A step with up to ONE_CALL_PREFILL_TOKENS prefill tokens runs on the one call, a
    row per token, and its logits stay as close to the float32 reference as the eager
    forward's; a step with more prefill takes the eager forward (engine.cpu_prefill: eager);
    decode-only steps the one call."""
    runners = _runners("llama", RUNNABLE[0], cpu_prefill="eager")
    r = runners["kernels"]
    calls = _one_call_rows(monkeypatch)
    small = [(5 * j + 3) % 128 for j in range(ONE_CALL_PREFILL_TOKENS)]
    logits = {}
    for name, each in runners.items():
        each.execute(batch(seq("b", [4, 5, 6], 0, [1])))
        logits[name] = each.logits_for(batch(seq("a", small, 0, list(range(2, 2 + 9))), seq("b", [7], 3, [1])))
    assert calls == [3, ONE_CALL_PREFILL_TOKENS + 1]  # b's prompt, then the mixed step
    ref = logits["reference"]
    err = {name: (logits[name] - ref).abs().max().item() for name in ("eager", "kernels")}
    assert err["kernels"] <= 1.5 * err["eager"] + 0.05, err
    calls.clear()
    # what the runner tells the ITL target's speed (a step ran as rows or on the eager forward)
    assert r.row_step_tokens == ONE_CALL_PREFILL_TOKENS and runners["eager"].row_step_tokens == 0
    assert r.runs_as_rows(batch(seq("a", small, 0, list(range(2, 2 + 9))), seq("b", [7], 3, [1])))
    large = [(5 * j + 3) % 128 for j in range(ONE_CALL_PREFILL_TOKENS + 1)]
    big = batch(seq("c", large, 0, list(range(20, 20 + 9))), seq("b", [8], 4, [1, 11]))
    assert not r.runs_as_rows(big)
    r.execute(big)
    assert calls == []
    r.execute(batch(seq("c", [9], len(large), list(range(20, 20 + 9))), seq("b", [9], 5, [1, 11])))
    assert calls == [2]


@EACH_ISA
def test_prefill_of_any_size_runs_as_rows_where_that_path_is_the_faster(isa: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """engine.cpu_prefill: auto sends a prefill of any size to the one call on the sets of
    ROWS_PREFILL_SETS (eager elsewhere); rows forces it, and its logits stay as close to the
    float32 reference as the eager forward's."""
    runners = _runners("llama", isa)
    assert runners["kernels"].prefill_rows == (isa in ROWS_PREFILL_SETS)
    model, arch = tiny_hf_model("llama")
    r = runners["kernels"] = TorchRunner(arch, model.state_dict(), EngineConfig(
        device="cpu", dtype="bfloat16", quantization="int4", quantized_max_rows=None, block_size=4,
        num_kv_blocks=256, cpu_kernels=True, cpu_isa=isa, cpu_prefill="rows"))
    assert r.prefill_rows
    calls = _one_call_rows(monkeypatch)
    large = [(5 * j + 3) % 128 for j in range(3 * ONE_CALL_PREFILL_TOKENS)]
    # a fresh prompt and one after a cached prefix, beside a decode

    def b() -> ScheduledBatch:
        return batch(seq("a", large, 0, list(range(2, 2 + 25))), seq("b", large[24:40], 24, list(range(40, 50))),
                     seq("c", [7], 3, [60]))

    logits = {}
    for name, each in runners.items():
        each.execute(batch(seq("b", large[:24], 0, list(range(40, 50))), seq("c", [4, 5, 6], 0, [60])))
        logits[name] = each.logits_for(b())
    assert calls == [24 + 3, 3 * ONE_CALL_PREFILL_TOKENS + 16 + 1]
    ref = logits["reference"]
    err = {name: (logits[name] - ref).abs().max().item() for name in ("eager", "kernels")}
    assert err["kernels"] <= 1.5 * err["eager"] + 0.05, err
    # the ITL target's regimes stay by size: a step this large is timed against the prefill fit
    assert r.row_step_tokens == ONE_CALL_PREFILL_TOKENS and not r.runs_as_rows(b())


def test_rows_prefill_without_the_one_call_is_an_error() -> None:
    model, arch = tiny_hf_model("llama")
    with pytest.raises(ValueError, match="engine.cpu_prefill: rows"):
        TorchRunner(arch, model.state_dict(), EngineConfig(device="cpu", dtype="bfloat16", quantization="int4",
                                                           cpu_kernels=False, cpu_prefill="rows", num_kv_blocks=64))


def test_decode_forward_refuses_bad_rows() -> None:
    r = _runners("llama", RUNNABLE[0])["kernels"]
    r.execute(batch(seq("a", [1, 2, 3], 0, [0])))
    with pytest.raises(RuntimeError, match="token id"):
        r.execute(batch(seq("a", [500], 3, [0])))


def _kernel_isa(r: TorchRunner) -> str:
    ks = r.model.layers[0].qkv_proj.matmul.kernels
    return "none" if ks is None else ks.isa


def test_cpu_kernels_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    model, arch = tiny_hf_model("llama")
    tensors = model.state_dict()
    best = isas.best(cpuinfo_flags())
    off = TorchRunner(arch, tensors, EngineConfig(device="cpu", dtype="bfloat16", quantization="int4", cpu_kernels=False))
    assert off.model.cpu_decode is None and _kernel_isa(off) == "none" and off.info.cpu_isa == "none"
    on = TorchRunner(arch, tensors, EngineConfig(device="cpu", dtype="bfloat16", quantization="int4"))  # auto
    assert on.model.cpu_decode is not None and _kernel_isa(on) == best and on.info.cpu_isa == best
    # engine.overlap auto: on beside the one-call step, off beside the eager forward
    assert on.overlap_pays and not off.overlap_pays
    none = TorchRunner(arch, tensors, EngineConfig(device="cpu", dtype="bfloat16", quantization="int4", cpu_isa="none"))
    assert none.model.cpu_decode is None and none.info.cpu_isa == "none"
    with pytest.raises(ValueError, match="cpu_kernels: true, but engine.cpu_isa resolved to none"):
        TorchRunner(arch, tensors, EngineConfig(device="cpu", dtype="bfloat16", quantization="int4", cpu_isa="none",
                                                cpu_kernels=True))
    fp32 = TorchRunner(arch, tensors, EngineConfig(device="cpu", dtype="float32", quantization="int4"))
    if build.load(best).float_input:  # the int8 paths take float32 activations in the eager forward
        assert _kernel_isa(fp32) == best
    assert fp32.model.cpu_decode is None  # the one-call step: bfloat16 (its KV cache) only
    with pytest.raises(ValueError, match="cpu_kernels: true"):
        TorchRunner(arch, tensors, EngineConfig(device="cpu", dtype="float16", quantization="int4", cpu_kernels=True))
    for isa in isas.ISAS:  # a forced set the CPU lacks: a start-up error naming what it lacks
        if isa not in RUNNABLE:
            with pytest.raises(ValueError, match=f"engine.cpu_isa={isa}: the CPU lacks"):
                TorchRunner(arch, tensors, EngineConfig(device="cpu", dtype="bfloat16", quantization="int4", cpu_isa=isa))
    with pytest.raises(ValueError, match="engine.cpu_isa=neon"):
        TorchRunner(arch, tensors, EngineConfig(device="cpu", quantization="int4", cpu_isa="neon"))

    def unavailable(isa: str) -> KernelSet:
        raise build.KernelUnavailable("g++ failed")

    monkeypatch.setattr(build, "load", unavailable)
    monkeypatch.setattr(build, "available", lambda isa: False)
    with pytest.raises(ValueError, match="g\\+\\+ failed"):
        TorchRunner(arch, tensors, EngineConfig(device="cpu", dtype="bfloat16", quantization="int4", cpu_kernels=True))
    fallback = TorchRunner(arch, tensors, EngineConfig(device="cpu", dtype="bfloat16", quantization="int4"))
    assert fallback.model.cpu_decode is None and _kernel_isa(fallback) == "none"


# CPUs users run on, by their flags (with the flags every one of them has).
_BASE = {"sse4_2", "avx", "fma", "f16c"}
_AVX512 = _BASE | {"avx2", "avx512f", "avx512bw", "avx512vl", "avx512dq"}
FLAG_SETS = {
    "no AVX2 (old x86)": (_BASE, "none"),
    "AVX2 laptop / Zen 2": (_BASE | {"avx2"}, "avx2"),
    "Alder Lake (AVX-VNNI)": (_BASE | {"avx2", "avx_vnni"}, "avx2"),
    "Skylake-SP": (_AVX512, "avx512"),
    "Cascade Lake / this Xeon": (_AVX512 | {"avx512_vnni", "avx512vbmi"}, "avx512_vnni"),
    "Zen 4 / Sapphire Rapids": (_AVX512 | {"avx512_vnni", "avx512_bf16"}, "avx512_bf16"),
    # aarch64's /proc/cpuinfo "Features"
    "Raspberry Pi 4 / Cortex-A72 (no dot product)": ({"fp", "asimd", "crc32", "cpuid"}, "none"),
    "Graviton 2 / Ampere Altra / Apple M1 under Linux": ({"fp", "asimd", "fphp", "asimdhp", "asimddp"}, "neon"),
}


@pytest.mark.parametrize("cpu", list(FLAG_SETS))
def test_auto_never_inflates_a_four_bit_model_to_dense_float32(cpu: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """engine.cpu_isa / dtype / quantization auto over each CPU's flags: the best kernel set
    it has, and a 4-bit model stays int4 (bfloat16 activations) on every one of them."""
    flags, want = FLAG_SETS[cpu]
    assert isas.best(flags) == want
    assert isas.resolve("auto", flags) == want
    four_bit = QuantSource(four_bit=True)
    cfg = EngineConfig(device="cpu")
    for fast_bf16 in (False, True):  # whatever torch's probe says about bfloat16 there
        monkeypatch.setattr(torch_runner, "cpu_has_fast_bf16", lambda fast=fast_bf16: fast)
        dtype = torch_runner.resolve_dtype("auto", torch.device("cpu"), torch_runner.stays_four_bit(cfg, four_bit))
        assert dtype == torch.bfloat16
        assert torch_runner.resolve_quantization(cfg, dtype, four_bit) == "int4"
    # the whole runner, where this CPU can run the set: the tiny model as a 4-bit file
    if want in RUNNABLE:
        monkeypatch.setattr(torch_runner, "cpuinfo_flags", lambda: frozenset(flags))
        model, arch = tiny_hf_model("llama")
        r = TorchRunner(arch, model.state_dict(), cfg, quant_source=four_bit)
        assert (r.dtype, r.quantization, r.info.cpu_isa) == (torch.bfloat16, "int4", want)
        assert r.model.cpu_decode is not None


@pytest.mark.skipif("avx2" not in RUNNABLE, reason="the avx2 kernels cannot run here")
def test_forced_avx2_keeps_no_bfloat16_dense_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU with AVX512-BF16 a 4-bit model keeps bfloat16 dense copies for batches of
    many rows; forced to avx2 (an AVX2 CPU's stand-in) every row count runs the int4 kernels."""
    monkeypatch.setattr(torch_runner, "cpu_has_fast_bf16", lambda: True)
    model, arch = tiny_hf_model("llama")
    dense = {}
    for setting in ("auto", "avx2"):
        r = TorchRunner(arch, model.state_dict(), EngineConfig(device="cpu", cpu_isa=setting),
                        quant_source=QuantSource(four_bit=True))
        linears = [m for m in r.model.modules() if isinstance(m, QuantizedLinear)]
        assert linears and r.dtype == torch.bfloat16
        dense[setting] = sum(m.dense is not None for m in linears)
    assert dense["auto"] > 0 and dense["avx2"] == 0


def test_library_is_built_once_per_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh cache directory builds the library; the file name keys the source, torch
    and the flags, so an edited kernel cannot load a stale build."""
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    best = isas.best(cpuinfo_flags())
    path = build._library_path(best)
    assert path.parent == tmp_path / "kernels" and path.name.startswith(f"tandem_cpu_{best}-")
    assert build.main([]) == 0
    assert path.exists() and list(path.parent.iterdir()) == [path]  # no temporary file left
    mtime = path.stat().st_mtime_ns
    assert build.main([]) == 0 and path.stat().st_mtime_ns == mtime  # built once
    assert len({build._library_path(i) for i in isas.ISAS}) == len(isas.ISAS)  # one build a set
    # an image builds every set (--all), and AVX2 with and without AVX-VNNI: whichever CPU
    # runs it finds its build without g++
    assert [len(isas.every_cflags(i)) for i in isas.ISAS] == [1, 1, 1, 2, 1]
    assert "-mavxvnni" in isas.cflags("avx2", {"avx2", "avx_vnni"}) and "-mavxvnni" not in isas.cflags("avx2", {"avx2"})


def test_the_chosen_path_is_a_worker_metric_label() -> None:
    from prometheus_client import CollectorRegistry

    from services.engine.engine import LLMEngine
    from services.engine.stats_metrics import EngineStatsCollector

    model, arch = tiny_hf_model("llama")
    cfg = EngineConfig(device="cpu", block_size=4, num_kv_blocks=16)
    r = TorchRunner(arch, model.state_dict(), cfg, quant_source=QuantSource(four_bit=True))
    reg = CollectorRegistry()
    reg.register(EngineStatsCollector(LLMEngine(r, cfg, [0]).stats))
    labels = {"device": "cpu", "dtype": "bfloat16", "quantization": "int4", "cpu_isa": isas.best(cpuinfo_flags())}
    assert reg.get_sample_value("tandem_worker_engine_info", labels) == 1


def test_a_machine_builds_only_its_own_architectures_sets() -> None:
    assert isas.for_machine("aarch64") == ("neon",)
    assert isas.for_machine("x86_64") == ("avx512_bf16", "avx512_vnni", "avx512", "avx2")
    assert isas.cflags("neon", frozenset()) == ("-march=armv8.2-a+dotprod",)
    with pytest.raises(ValueError, match="lacks asimddp"):
        isas.resolve("neon", frozenset({"fp", "asimd"}))
