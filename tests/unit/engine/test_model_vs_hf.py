"""The torch model over the paged KV cache reproduces Hugging Face's logits."""

from __future__ import annotations

import pytest
import torch

from tests.support.tiny_model import batch, hf_logits, make_runner, seq, tiny_hf_model

TOL = 1e-4
CASES = [("llama", False), ("llama", True), ("qwen2", False), ("qwen2", True)]


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (n,), generator=g).tolist()


@pytest.fixture(params=CASES, ids=[f"{a}-{'tied' if t else 'untied'}" for a, t in CASES])
def setup(request):
    arch_name, tie = request.param
    hf, arch = tiny_hf_model(arch_name, tie)
    runner = make_runner(arch, hf.state_dict())
    return hf, runner


def test_full_prompt_one_step(setup):
    hf, runner = setup
    prompt = _prompt(11, 1)
    got = runner.logits_for(batch(seq("a", prompt, 0, [5, 2, 9])))
    want = hf_logits(hf, prompt)[-1:]
    assert (got - want).abs().max().item() < TOL


def test_chunked_prefill_then_decode(setup):
    hf, runner = setup
    prompt = _prompt(13, 2)
    blocks = [7, 3, 12, 0, 30, 31]  # non-contiguous, out of order
    full = hf_logits(hf, prompt + [0] * 0)
    # Chunks of 5, 3 (start_pos > 0, not block-aligned) and 5 tokens.
    for start, end in [(0, 5), (5, 8), (8, 13)]:
        got = runner.logits_for(batch(seq("a", prompt[start:end], start, blocks)))
        assert (got - full[end - 1 : end]).abs().max().item() < TOL
    tokens = list(prompt)
    for _ in range(6):
        nxt = int(hf_logits(hf, tokens)[-1].argmax())
        tokens.append(nxt)
        got = runner.logits_for(batch(seq("a", [nxt], len(tokens) - 1, blocks)))
        want = hf_logits(hf, tokens)[-1:]
        assert (got - want).abs().max().item() < TOL


def test_mixed_batch_prefills_and_decodes(setup):
    hf, runner = setup
    # Three sequences first prefill (one of them in two chunks); then a mixed step holding
    # two decodes, one continuing prefill chunk and one brand-new prompt.
    a, b, c, d = _prompt(9, 3), _prompt(4, 4), _prompt(15, 5), _prompt(6, 6)
    ta, tb, tc, td = [40, 2, 19], [17], [5, 33, 8, 21], [11, 9]
    step1 = batch(seq("a", a, 0, ta), seq("b", b, 0, tb), seq("c", c[:6], 0, tc, sample=False))
    got1 = runner.logits_for(step1)
    assert got1.shape == (2, 128)
    assert (got1[0] - hf_logits(hf, a)[-1]).abs().max().item() < TOL
    assert (got1[1] - hf_logits(hf, b)[-1]).abs().max().item() < TOL

    na, nb = int(got1[0].argmax()), int(got1[1].argmax())
    tb2 = tb + [18]
    step2 = batch(
        seq("a", [na], len(a), ta),
        seq("c", c[6:], 6, tc),
        seq("b", [nb], len(b), tb2),  # crosses into a new block
        seq("d", d, 0, td),
    )
    got2 = runner.logits_for(step2)
    want = [hf_logits(hf, a + [na])[-1], hf_logits(hf, c)[-1], hf_logits(hf, b + [nb])[-1], hf_logits(hf, d)[-1]]
    for i, w in enumerate(want):
        assert (got2[i] - w).abs().max().item() < TOL, f"row {i}"


def test_many_decodes_in_one_batch(setup):
    """Decode sequences of very different lengths share one padded, masked attention call."""
    hf, runner = setup
    lengths = [1, 3, 4, 8, 13]
    prompts = [_prompt(n, 10 + n) for n in lengths]
    tables = [[10 + 6 * i + j for j in range(5)][::-1] for i in range(len(lengths))]  # descending ids
    first = runner.logits_for(batch(*[seq(f"s{i}", p, 0, tables[i]) for i, p in enumerate(prompts)]))
    seqs = [p + [int(first[i].argmax())] for i, p in enumerate(prompts)]
    for _ in range(3):
        step = batch(*[seq(f"s{i}", [t[-1]], len(t) - 1, tables[i]) for i, t in enumerate(seqs)])
        got = runner.logits_for(step)
        for i, t in enumerate(seqs):
            assert (got[i] - hf_logits(hf, t)[-1]).abs().max().item() < TOL, f"seq {i}"
        for i, t in enumerate(seqs):
            t.append(int(got[i].argmax()))


def test_prefix_cache_hit_reuses_blocks(setup):
    """A second request sharing a cached prefix block starts at start_pos > 0."""
    hf, runner = setup
    prompt = _prompt(10, 7)
    runner.logits_for(batch(seq("a", prompt, 0, [3, 8, 1], sample=False)))
    other = prompt[:8] + _prompt(5, 8)
    got = runner.logits_for(batch(seq("b", other[8:], 8, [3, 8, 20, 21])))
    assert (got[0] - hf_logits(hf, other)[-1]).abs().max().item() < TOL


def test_load_rejects_bad_tensors():
    hf, arch = tiny_hf_model("llama")
    sd = hf.state_dict()
    missing = {k: v for k, v in sd.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        make_runner(arch, missing)
    with pytest.raises(ValueError, match="model.extra.weight"):
        make_runner(arch, {**sd, "model.extra.weight": torch.zeros(1)})
    bad = dict(sd)
    bad["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(5, 64)
    with pytest.raises(ValueError, match="k_proj.weight.*shape"):
        make_runner(arch, bad)


def test_bad_batch_is_rejected():
    hf, arch = tiny_hf_model("llama")
    runner = make_runner(arch, hf.state_dict())
    with pytest.raises(ValueError, match="'x'.*blocks"):
        runner.execute(batch(seq("x", _prompt(9, 1), 0, [1, 2])))
    with pytest.raises(ValueError, match="'y'.*out of range"):
        runner.execute(batch(seq("y", [1], 0, [64])))


def _check_bf16(device: str, arch_name: str) -> None:
    """bf16 against the float32 HF reference: rounding noise only (a wrong position or
    cache slot moves logits by ~2, see the sensitivity of these tiny models)."""
    hf, arch = tiny_hf_model(arch_name)
    runner = make_runner(arch, hf.state_dict(), device=device, dtype="bfloat16")
    prompt = _prompt(12, 9)
    want = hf_logits(hf, prompt)
    blocks = [9, 4, 22, 13]
    first = runner.logits_for(batch(seq("a", prompt[:7], 0, blocks)))[0]
    second = runner.logits_for(batch(seq("a", prompt[7:], 7, blocks)))[0]
    for got, ref in ((first, want[6]), (second, want[11])):
        assert (got - ref).abs().max().item() < 0.25
        assert torch.nn.functional.cosine_similarity(got, ref, dim=0).item() > 0.999


@pytest.mark.parametrize("arch_name", ["llama", "qwen2"])
def test_bf16_cpu_matches_hf(arch_name):
    _check_bf16("cpu", arch_name)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch_name", ["llama", "qwen2"])
def test_bf16_cuda_matches_hf(arch_name):
    _check_bf16("cuda", arch_name)
