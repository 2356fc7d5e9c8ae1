"""The shifting workload: seeded, its phases in order with their rates and lengths."""

from __future__ import annotations

import pytest

from services.sim.shifting import SPREAD, Phase, shifting, shifting_phases


def test_same_seed_same_requests_other_seed_others() -> None:
    phases = shifting_phases(8, 60.0)
    assert shifting(phases, 1) == shifting(phases, 1)
    assert shifting(phases, 1) != shifting(phases, 2)


def test_phases_in_order_with_their_rates_and_lengths() -> None:
    phases = [Phase(100.0, 5.0, 300, 1000), Phase(100.0, 3.0, 2000, 40)]
    reqs = shifting(phases, 0)
    assert [r.index for r in reqs] == list(range(len(reqs)))
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(reqs, reqs[1:], strict=False))
    for k, ph in enumerate(phases):
        mine = [r for r in reqs if k * 100.0 <= r.arrival_s < (k + 1) * 100.0]
        assert len(mine) == pytest.approx(ph.rate * ph.duration_s, rel=0.2)
        for r in mine:
            assert ph.input_tokens * (1 - SPREAD) - 1 <= r.input_len <= ph.input_tokens * (1 + SPREAD) + 1
            assert ph.output_tokens * (1 - SPREAD) - 1 <= r.output_len <= ph.output_tokens * (1 + SPREAD) + 1


def test_budget_scales_the_rates_and_the_load_shifts() -> None:
    a, b, c = shifting_phases(8)
    assert a == c and a.input_tokens < b.input_tokens and a.output_tokens > b.output_tokens
    assert shifting_phases(16)[1].rate == pytest.approx(2 * b.rate)


def test_time_scale_stretches_each_phase_and_thins_its_arrivals() -> None:
    for slow, fast in zip(shifting_phases(8, 60.0, 3.0), shifting_phases(8, 60.0), strict=True):
        assert slow.duration_s == pytest.approx(3 * fast.duration_s)
        assert slow.rate == pytest.approx(fast.rate / 3)
        assert (slow.input_tokens, slow.output_tokens) == (fast.input_tokens, fast.output_tokens)
