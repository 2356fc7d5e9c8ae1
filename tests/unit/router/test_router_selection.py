"""The pure selection function and the load tracker."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from services.api.wire import WorkerLoad
from services.router.load import LoadTracker
from services.router.selection import Candidate, cost, select_worker


def test_cost_formula() -> None:
    c = Candidate("w", overlap_blocks=6, pending_prefill_blocks=2, active_blocks=30)
    # prefill = (10 - 6) + 2 = 6 ; decode = 30 + 10 = 40
    assert cost(c, 10, overlap_weight=2.0) == 2.0 * 6 + 40
    # overlap beyond the request never makes prefill negative
    assert cost(Candidate("w", 12, 0, 0), 10, 1.0) == 0 + 10


def test_overlap_wins_until_load_outweighs_it() -> None:
    rng = random.Random(0)
    holder = Candidate("holder", 8, 0, 0)
    idle = Candidate("idle", 0, 0, 0)
    assert select_worker([idle, holder], 10, 1.0, 0.0, rng).worker_id == "holder"
    busy_holder = Candidate("holder", 8, 0, 50)
    assert select_worker([idle, busy_holder], 10, 1.0, 0.0, rng).worker_id == "idle"
    s = select_worker([idle, holder], 10, 1.0, 0.0, rng)
    assert (s.overlap_blocks, s.cost) == (8, 2 + 10)


def test_ties_go_to_lighter_then_random() -> None:
    rng = random.Random(1)
    # equal cost: a has more active blocks but more overlap
    a = Candidate("a", 5, 0, 5)
    b = Candidate("b", 0, 0, 0)
    assert cost(a, 10, 1.0) == cost(b, 10, 1.0)
    assert select_worker([a, b], 10, 1.0, 0.0, rng).worker_id == "b"
    picks = Counter(
        select_worker([Candidate(w, 0, 0, 0) for w in "wxyz"], 4, 1.0, 0.0, rng).worker_id
        for _ in range(400)
    )
    assert set(picks) == set("wxyz")


def test_temperature_samples_but_prefers_cheap() -> None:
    rng = random.Random(2)
    cheap, dear = Candidate("cheap", 10, 0, 0), Candidate("dear", 0, 0, 40)
    picks = Counter(select_worker([cheap, dear], 10, 1.0, 0.5, rng).worker_id for _ in range(400))
    assert picks["cheap"] > picks["dear"] > 0


def test_selection_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="no candidate"):
        select_worker([], 1, 1.0, 0.0, random.Random())
    with pytest.raises(ValueError, match="temperature"):
        select_worker([Candidate("a", 0, 0, 0)], 1, 1.0, -1.0, random.Random())


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_load_tracker_inflight_phases_and_metrics_merge() -> None:
    clock = FakeClock()
    lt = LoadTracker(block_size=16, inflight_ttl_s=60, load_stale_s=5, clock=clock)
    lt.add("r1", "w", prompt_blocks=10, prefill_blocks=7)
    lt.add("r2", "w", prompt_blocks=4, prefill_blocks=4)
    lt.add("r2", "w", prompt_blocks=4, prefill_blocks=4)  # duplicate id: no-op
    v = lt.view("w")
    assert (v.pending_prefill_blocks, v.active_blocks) == (11, 14)
    lt.prefilled("r1")
    assert lt.view("w").pending_prefill_blocks == 4
    lt.free("r2")
    assert (lt.view("w").pending_prefill_blocks, lt.view("w").active_blocks) == (0, 10)
    # metrics larger than the in-flight view win; the max never double-counts
    lt.update_metrics(WorkerLoad("w", 25, 100, 2, 0, 33, 0.0))
    assert (lt.view("w").pending_prefill_blocks, lt.view("w").active_blocks) == (3, 25)
    clock.t += 6  # stale metrics are ignored
    assert lt.view("w").active_blocks == 10
    clock.t += 60  # in-flight entries expire when their free was lost
    lt.add("r3", "v", 1, 1)
    assert lt.view("w").active_blocks == 0 and lt.inflight_count() == 1
    lt.remove_worker("v")
    assert lt.inflight_count() == 0


def test_ttft_views_match_view() -> None:
    clock = FakeClock()
    lt = LoadTracker(block_size=16, inflight_ttl_s=60, load_stale_s=5, clock=clock)
    lt.add("r1", "a", 10, 7)
    lt.update_metrics(WorkerLoad("b", 25, 100, 2, 0, 33, 0.0))
    got = [(prefill, active) for prefill, active, _, _ in lt.ttft_views(["a", "b", "c"])]
    assert got == [(v.pending_prefill_blocks, v.active_blocks) for v in map(lt.view, "abc")]
    assert got == [(7, 10), (3, 25), (0, 0)]
