"""Sampler: greedy, top-k, top-p, temperature and reproducible per-request seeds.

Statistical checks use fixed seeds (so they are deterministic) and tolerances of many
standard deviations (so a different but correct RNG stream would pass too).
"""

from __future__ import annotations

import math

import pytest
import torch

from services.api.sampling import SamplingParams, choice_seed
from services.engine.sampler import Sampler, filter_min_p, filter_top_k_top_p
from tests.support.tiny_model import seq

V = 64


def _seqs(n: int, sp: SamplingParams, num_generated: int = 0):
    return [seq(f"r{i}", [1], 0, [0], sampling=sp, num_generated=num_generated) for i in range(n)]


def _counts(tokens: list[int]) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=V).float()


def test_greedy_is_argmax():
    logits = torch.randn(8, V, generator=torch.Generator().manual_seed(0))
    out = Sampler(0).sample(logits, _seqs(8, SamplingParams(temperature=0.0)))
    assert out == logits.argmax(-1).tolist()


def test_top_k_one_is_greedy_even_with_temperature():
    logits = torch.randn(8, V, generator=torch.Generator().manual_seed(1))
    out = Sampler(0).sample(logits, _seqs(8, SamplingParams(temperature=1.5, top_k=1)))
    assert out == logits.argmax(-1).tolist()


def test_greedy_and_random_rows_mix():
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(2))
    seqs = _seqs(4, SamplingParams(temperature=1.0))
    seqs[1] = seq("g", [1], 0, [0], sampling=SamplingParams(temperature=0.0))
    out = Sampler(0).sample(logits, seqs)
    assert out[1] == int(logits[1].argmax())


def _nucleus_logits(n: int) -> torch.Tensor:
    probs = torch.full((V,), 0.05 / (V - 3))
    probs[:3] = torch.tensor([0.5, 0.3, 0.15])
    return probs.log().expand(n, V).clone()


def test_top_p_keeps_the_nucleus():
    n = 4000
    # Mass before token 1 is 0.5 < 0.7 (kept); before token 2 it is 0.8 (dropped).
    out = Sampler(3).sample(_nucleus_logits(n), _seqs(n, SamplingParams(top_p=0.7)))
    c = _counts(out)
    assert set(out) == {0, 1}
    frac0 = c[0].item() / n  # renormalised: 0.5 / 0.8 = 0.625, sd ~ 0.008
    assert abs(frac0 - 0.625) < 0.05


def test_top_k_keeps_the_k_best():
    n = 2000
    out = Sampler(4).sample(_nucleus_logits(n), _seqs(n, SamplingParams(top_k=3)))
    assert set(out) == {0, 1, 2}


def test_min_p_drops_tokens_below_its_share_of_the_best():
    n = 4000
    # probabilities 0.5, 0.3, 0.15, then ~0.0008 each: min_p 0.5 keeps p >= 0.25 (tokens 0, 1)
    out = Sampler(3).sample(_nucleus_logits(n), _seqs(n, SamplingParams(min_p=0.5)))
    assert set(out) == {0, 1}
    frac0 = _counts(out)[0].item() / n  # renormalised: 0.5 / 0.8 = 0.625, sd ~ 0.008
    assert abs(frac0 - 0.625) < 0.05


def test_min_p_near_one_at_temperature_one_is_greedy():
    logits = torch.randn(64, V, generator=torch.Generator().manual_seed(11))
    out = Sampler(0).sample(logits, _seqs(64, SamplingParams(temperature=1.0, min_p=0.999)))
    assert out == logits.argmax(-1).tolist()


def test_min_p_applies_after_temperature_and_per_row():
    # Token 1 holds 0.3/0.5 = 0.6 of the best's probability at temperature 1; at temperature
    # 0.25 it holds 0.6**4 = 0.13, below min_p 0.2: dropped only there. Row 1 has no min_p.
    logits = _nucleus_logits(2)
    params = [SamplingParams(temperature=0.25, min_p=0.2), SamplingParams(temperature=0.25)]
    kept = filter_min_p(logits / 0.25, params).isfinite()
    assert kept[0].nonzero().flatten().tolist() == [0]
    assert bool(kept[1].all())


def test_min_p_out_of_range_is_refused():
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(min_p=1.5)


def test_full_distribution_is_followed():
    n = 8000
    logits = torch.randn(V, generator=torch.Generator().manual_seed(5)) * 2
    probs = torch.softmax(logits, -1)
    out = Sampler(6).sample(logits.expand(n, V).clone(), _seqs(n, SamplingParams()))
    freq = _counts(out) / n
    sd = (probs * (1 - probs) / n).sqrt()
    assert ((freq - probs).abs() <= 6 * sd + 1e-3).all()


def test_temperature_sharpens_and_flattens():
    n = 4000
    logits = torch.randn(V, generator=torch.Generator().manual_seed(7)).expand(n, V).clone()
    top = int(logits[0].argmax())
    cold = _counts(Sampler(8).sample(logits, _seqs(n, SamplingParams(temperature=0.3))))[top] / n
    hot = _counts(Sampler(8).sample(logits, _seqs(n, SamplingParams(temperature=3.0))))[top] / n
    expect_cold = torch.softmax(logits[0] / 0.3, -1)[top].item()
    expect_hot = torch.softmax(logits[0] / 3.0, -1)[top].item()
    assert expect_cold - expect_hot > 0.2  # the test means something
    assert abs(cold - expect_cold) < 6 * math.sqrt(0.25 / n)
    assert abs(hot - expect_hot) < 6 * math.sqrt(0.25 / n)


@pytest.mark.parametrize("sp", [SamplingParams(seed=42), SamplingParams(seed=42, top_p=0.9, top_k=20)])
def test_same_seed_same_token_whatever_the_batch(sp):
    logits = torch.zeros(1, V)  # uniform: the draw is all noise
    alone = [Sampler(0).sample(logits, [seq("a", [1], 0, [0], sampling=sp, num_generated=g)])[0] for g in range(12)]
    for g in range(12):
        others = [
            seq("x", [1], 0, [0], sampling=SamplingParams()),
            seq("y", [1], 0, [0], sampling=SamplingParams(seed=7)),
            seq("z", [1], 0, [0], sampling=SamplingParams(temperature=0.0)),
        ]
        mine = seq("a", [1], 0, [0], sampling=sp, num_generated=g)
        mixed = Sampler(g + 100).sample(torch.zeros(4, V), [*others[:2], mine, others[2]])
        assert mixed[2] == alone[g]
    assert len(set(alone)) > 3  # the step number changes the draw


def test_a_row_invariant_sampler_draws_what_the_batched_one_draws():
    """row_invariant (engine.deterministic on CUDA) draws row by row: same seeded tokens,
    greedy rows still argmax, logprobs still per row."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, V, generator=g) * 3
    sps = [SamplingParams(seed=i, temperature=0.8, top_p=0.9 if i % 2 else 1.0, logprobs=2) for i in range(5)]
    seqs = [seq(f"r{i}", [1], 0, [0], sampling=sp, num_generated=4) for i, sp in enumerate(sps)]
    seqs.append(seq("g", [1], 0, [0], sampling=SamplingParams(temperature=0.0, logprobs=2)))
    batched = Sampler(0).sample_tensor(logits.clone(), seqs)
    rows = Sampler(0, row_invariant=True).sample_tensor(logits.clone(), seqs)
    assert rows.tokens.tolist() == batched.tokens.tolist()
    assert rows.tokens[5].item() == logits[5].argmax().item()
    torch.testing.assert_close(rows.logprob, batched.logprob)


def test_different_seeds_differ_and_unseeded_follow_engine_seed():
    logits = torch.zeros(16, V)
    a = Sampler(0).sample(logits, [seq(f"{i}", [1], 0, [0], sampling=SamplingParams(seed=i)) for i in range(16)])
    assert len(set(a)) > 4
    s1 = Sampler(11).sample(logits, _seqs(16, SamplingParams()))
    s2 = Sampler(11).sample(logits, _seqs(16, SamplingParams()))
    assert s1 == s2


def test_a_choice_is_part_of_the_key_not_an_offset_of_the_seed():
    sp = SamplingParams(seed=7, n=3)
    assert sp.for_choice(0).seed == 7  # choice 0 draws as the n=1 request
    seeds = [sp.for_choice(i).seed for i in range(3)]
    assert len(set(seeds)) == 3 and 8 not in seeds  # choice 1 of seed 7 is not seed 8's
    assert all(-(1 << 63) <= s < 1 << 63 for s in seeds)
    assert choice_seed(-1, 5) == SamplingParams(seed=-1, n=6).for_choice(5).seed
    logits = torch.zeros(1, V)
    draws = [[Sampler(0).sample(logits, [seq("a", [1], 0, [0], sampling=sp.for_choice(c),
                                             num_generated=g)])[0] for g in range(8)]
             for c in range(3)]
    assert len({tuple(d) for d in draws}) == 3


def test_row_count_mismatch_is_an_error():
    with pytest.raises(ValueError, match="rows"):
        Sampler(0).sample(torch.zeros(2, V), _seqs(3, SamplingParams()))


def _reference_filter(row: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Brute force: full sort, top-k, renormalise, keep while the mass before is < top_p."""
    order = row.argsort(descending=True).tolist()
    kept = order[: top_k if top_k > 0 else len(order)]
    probs = torch.softmax(row[kept], -1).tolist()
    nucleus, before = [], 0.0
    for tok, p in zip(kept, probs, strict=True):
        if nucleus and top_p < 1.0 and before >= top_p:
            break
        nucleus.append(tok)
        before += p
    out = torch.full_like(row, float("-inf"))
    out[nucleus] = row[nucleus]
    return out


@pytest.mark.parametrize("scale", [0.05, 1.0, 8.0])  # flat (full-sort fallback) .. peaked (candidates)
def test_filter_matches_brute_force_on_a_large_vocab(scale):
    vocab = 5000  # > TOP_P_CANDIDATES
    params = [
        SamplingParams(top_p=0.9),
        SamplingParams(top_k=40),
        SamplingParams(top_k=2000, top_p=0.5),
        SamplingParams(),  # untouched
        SamplingParams(top_p=0.3),
    ]
    logits = torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(9)) * scale
    got = filter_top_k_top_p(logits, params)
    for i, p in enumerate(params):
        want = _reference_filter(logits[i], p.top_k, p.top_p)
        # Kept sets equal except possibly a token right at the top_p boundary (float sums).
        diff = (torch.isinf(got[i]) != torch.isinf(want)).sum().item()
        assert diff <= 1, f"row {i}: {diff} tokens differ"
        kept = ~torch.isinf(got[i])
        assert torch.equal(got[i][kept], logits[i][kept])
    assert torch.equal(got[3], logits[3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_takes_the_first_maximum_as_argmax_does(dtype):
    # bfloat16 logits tie often; a NaN wins as in argmax
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(6, 4096, generator=g) * 0.05).to(dtype)
    logits[1, 10] = logits[1, 3000] = logits[1].max() + 1
    logits[2, 7] = float("nan")
    logits[3] = float("-inf")
    assert (logits == logits.max(dim=-1, keepdim=True).values).sum() > logits.shape[0]  # ties exist
    out = Sampler(0).sample(logits, _seqs(6, SamplingParams(temperature=0.0)))
    assert out == logits.argmax(-1).tolist()
    assert out[1] == 10 and out[2] == 7
