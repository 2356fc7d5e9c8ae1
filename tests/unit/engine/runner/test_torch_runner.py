"""TorchRunner: execute semantics, seeded reproducibility and KV export/import."""

from __future__ import annotations

import pytest
import torch

from services.api.sampling import SamplingParams
from services.common.config import EngineConfig
from services.engine.cpu_kernels import cpu_features
from services.engine.runner import torch_runner
from services.engine.runner.torch_runner import TorchRunner, resolve_device, resolve_dtype
from tests.support.tiny_model import batch, hf_logits, make_runner, seq, tiny_hf_model


@pytest.fixture(scope="module")
def hf_and_arch():
    return tiny_hf_model("llama")


PROMPT = [5, 17, 99, 3, 42, 8, 61, 77, 23, 1]


def test_auto_resolves_to_cpu_and_the_dtype_the_cpu_runs_fast(monkeypatch: pytest.MonkeyPatch):
    if torch.cuda.is_available():
        pytest.skip("auto picks cuda on this machine")
    dev = resolve_device("auto")
    assert dev.type == "cpu"
    with pytest.raises(ValueError, match="engine.device"):
        resolve_device("cuda:0")
    monkeypatch.setattr(torch_runner, "cpu_has_fast_bf16", lambda: True)
    assert resolve_dtype("auto", dev) == torch.bfloat16
    monkeypatch.setattr(torch_runner, "cpu_has_fast_bf16", lambda: False)
    assert resolve_dtype("auto", dev) == torch.float32
    assert resolve_dtype("float32", dev) == torch.float32  # an explicit dtype is kept
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16


def test_a_forced_set_without_bf16_chooses_as_a_cpu_without_it(monkeypatch: pytest.MonkeyPatch):
    """engine.cpu_isa avx2 on a CPU with AVX512-BF16 stands in for an AVX2 CPU: float32 for
    a dense model, and no bfloat16 dense matmuls beside the int4 kernels."""
    cpu = torch.device("cpu")
    monkeypatch.setattr(torch_runner, "cpu_has_fast_bf16", lambda: True)
    for setting in ("auto", "avx512_bf16", "none"):
        assert resolve_dtype("auto", cpu, cpu_isa_setting=setting) == torch.bfloat16
        assert torch_runner.resolve_dense_above_rows("auto", cpu, torch.bfloat16, setting) == 16
    for setting in ("avx512_vnni", "avx512", "avx2", "neon"):
        assert resolve_dtype("auto", cpu, cpu_isa_setting=setting) == torch.float32
        assert resolve_dtype("auto", cpu, four_bit=True, cpu_isa_setting=setting) == torch.bfloat16
        assert torch_runner.resolve_dense_above_rows("auto", cpu, torch.bfloat16, setting) is None
    assert torch_runner.resolve_dense_above_rows(8, cpu, torch.bfloat16, "avx2") == 8  # a set count is kept


def test_cpu_bf16_probe_agrees_with_proc_cpuinfo():
    flags = cpu_features.cpuinfo_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo flags here")
    assert cpu_features.cpu_has_fast_bf16() == bool({"avx512_bf16", "amx_bf16"} & flags)


def test_runner_builds_cache_from_config(hf_and_arch):
    hf, arch = hf_and_arch
    r = TorchRunner(arch, hf.state_dict(), EngineConfig(dtype="float32", block_size=8, num_kv_blocks=10), max_model_len=100)
    scratch = 1 if r.graphs is not None else 0  # CUDA graphs' padding rows write one block past the pool
    assert r.kv_cache.shape == (2, 2, 10 + scratch, 8, 2, 16)
    assert r.kv_spec.num_blocks == 10 and r.max_model_len == 100 and r.vocab_size == 128


def test_execute_samples_only_where_asked(hf_and_arch):
    hf, arch = hf_and_arch
    r = make_runner(arch, hf.state_dict())
    out = r.execute(batch(seq("a", PROMPT[:6], 0, [1, 2]), seq("b", PROMPT, 0, [3, 4, 5], sample=False)))
    assert out.sampled[1] is None
    assert out.sampled[0] == int(hf_logits(hf, PROMPT[:6])[-1].argmax())
    assert r.execute(batch()).sampled == []


@pytest.mark.parametrize("overlapped", [False, True])
def test_prompt_logprobs_match_a_full_forward_across_chunks(hf_and_arch, overlapped: bool):
    """Two chunks of one prompt beside another sequence (a decode-shaped row first): each
    chunk's prompt targets get the logprobs of the full causal forward, top-k included."""
    hf, arch = hf_and_arch
    r = make_runner(arch, hf.state_dict())
    sp = SamplingParams(temperature=0, prompt_logprobs=2)
    ref = torch.log_softmax(hf_logits(hf, PROMPT), -1)  # (T, V)
    got = []
    for start, end in ((0, 6), (6, 10)):
        s = seq("p", PROMPT[start:end], start, [1, 2, 3], sample=end == 10, sampling=sp)
        s.prompt_targets = tuple(PROMPT[start + 1 : min(end, 9) + 1])
        b = batch(seq("o", [7], 0, [9], sample=False), s)
        out = r.launch(b).result() if overlapped else r.execute(b)
        assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
        got += out.prompt_logprobs[1]
    assert [lp.token_id for lp in got] == PROMPT[1:]
    want = [ref[i, PROMPT[i + 1]].item() for i in range(9)]
    assert [lp.logprob for lp in got] == pytest.approx(want, abs=1e-4)
    for i, lp in enumerate(got):
        top_v, top_i = ref[i].topk(2)
        assert [t for t, _ in lp.top] == top_i.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top_v.tolist(), abs=1e-4)


def test_seeded_sampling_reproducible_across_runners(hf_and_arch):
    hf, arch = hf_and_arch
    sp = SamplingParams(temperature=1.0, seed=1234)

    def generate(runner: TorchRunner, with_neighbour: bool) -> list[int]:
        tokens, out = list(PROMPT), []
        step = batch(seq("a", tokens, 0, [0, 1, 2, 3, 4, 5], sampling=sp))
        for g in range(8):
            if with_neighbour:
                step.seqs.append(seq("n", [g + 1], g, [9, 10, 11], sampling=SamplingParams()))
            tok = runner.execute(step).sampled[0]
            out.append(tok)
            tokens.append(tok)
            step = batch(seq("a", [tok], len(tokens) - 1, [0, 1, 2, 3, 4, 5], sampling=sp, num_generated=g + 1))
        return out

    a = generate(make_runner(arch, hf.state_dict(), seed=1), with_neighbour=False)
    b = generate(make_runner(arch, hf.state_dict(), seed=2), with_neighbour=True)
    assert a == b


def test_export_import_round_trip_into_other_blocks(hf_and_arch):
    hf, arch = hf_and_arch
    src = make_runner(arch, hf.state_dict())
    dst = make_runner(arch, hf.state_dict())
    src.execute(batch(seq("a", PROMPT, 0, [6, 2, 9], sample=False)))  # 10 tokens, block_size 4
    data = src.export_kv([6, 2, 9])
    assert data.shape == src.kv_spec.block_range_shape(3) and data.dtype == torch.float32
    dst.import_kv([30, 11, 4], data)
    nxt = 55
    want = src.logits_for(batch(seq("a", [nxt], len(PROMPT), [6, 2, 9])))
    got = dst.logits_for(batch(seq("a", [nxt], len(PROMPT), [30, 11, 4])))
    assert torch.allclose(got, want, atol=1e-6, rtol=0)
    # And the imported KV is the right KV, not just a consistent one.
    assert (got[0] - hf_logits(hf, PROMPT + [nxt])[-1]).abs().max().item() < 1e-4


def test_export_is_a_copy(hf_and_arch):
    hf, arch = hf_and_arch
    r = make_runner(arch, hf.state_dict())
    r.execute(batch(seq("a", PROMPT[:4], 0, [3], sample=False)))
    data = r.export_kv([3])
    data.zero_()
    assert r.kv_cache[:, :, 3].abs().sum() > 0


def test_import_rejects_bad_shape_dtype_and_ids(hf_and_arch):
    hf, arch = hf_and_arch
    r = make_runner(arch, hf.state_dict())
    good = torch.zeros(r.kv_spec.block_range_shape(2))
    with pytest.raises(ValueError, match="shape"):
        r.import_kv([1, 2, 3], good)
    with pytest.raises(ValueError, match="shape"):
        r.import_kv([1, 2], torch.zeros(2, 2, 2, 4, 2, 8))
    with pytest.raises(ValueError, match="dtype"):
        r.import_kv([1, 2], good.to(torch.bfloat16))
    with pytest.raises(ValueError, match="out of range"):
        r.import_kv([1, 64], good)
    with pytest.raises(ValueError, match="duplicate"):
        r.import_kv([1, 1], good)
    with pytest.raises(ValueError, match="out of range"):
        r.export_kv([-1])



def _cudnn_flags_at_attention(r: TorchRunner, monkeypatch: pytest.MonkeyPatch) -> tuple[list[bool], list[bool]]:
    """Whether the cuDNN SDPA backend was enabled at each attention call of a prefill step
    and of the decode step after it."""
    from services.engine.layers import attention

    seen: list[bool] = []
    sdpa = attention.F.scaled_dot_product_attention

    def spy(*a, **kw):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*a, **kw)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    r.execute(batch(seq("a", PROMPT, 0, [0, 1, 2])))
    prefill, seen[:] = seen[:], []
    r.execute(batch(seq("a", [7], len(PROMPT), [0, 1, 2])))
    return prefill, seen


def test_prefill_attention_backends_apply_to_prefill_steps_only(hf_and_arch, monkeypatch: pytest.MonkeyPatch):
    """The mechanism on CPU (the runner sets it on CUDA only): with ``prefill_attention``
    set, a prefill step attends without cuDNN, a decode step with torch's defaults, and the
    logits do not change."""
    hf, arch = hf_and_arch
    r = make_runner(arch, hf.state_dict())
    assert r.prefill_attention is None  # CPU: torch's own choice
    r.prefill_attention = torch_runner.PREFILL_SDPA_BACKENDS
    want = hf_logits(hf, PROMPT)[-1]
    got = r.logits_for(batch(seq("a", PROMPT, 0, [0, 1, 2])))[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    r = make_runner(arch, hf.state_dict())
    r.prefill_attention = torch_runner.PREFILL_SDPA_BACKENDS
    prefill, decode = _cudnn_flags_at_attention(r, monkeypatch)
    assert prefill and not any(prefill)
    assert decode and all(decode)
    assert torch.backends.cuda.cudnn_sdp_enabled()  # the context leaves the flags as they were


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_prefill_attention_skips_cudnn_and_decode_keeps_it(hf_and_arch, monkeypatch: pytest.MonkeyPatch):
    """cuDNN attention builds a plan per new shape (~40 ms on an H200): prefill steps, whose
    shapes are prompt lengths, must not use it; eager pure-decode steps keep the defaults."""
    hf, arch = hf_and_arch
    r = TorchRunner(arch, hf.state_dict(), EngineConfig(device="cuda", dtype="float32", block_size=4,
                                                        num_kv_blocks=16, cuda_graphs=False))
    assert r.prefill_attention == torch_runner.PREFILL_SDPA_BACKENDS
    prefill, decode = _cudnn_flags_at_attention(r, monkeypatch)
    assert prefill and not any(prefill)
    assert decode and all(decode)
