"""The forward model and the simulate policy: the split that serves the load predicts the
better goodput, a new worker's ready time is charged, ties go to fewer workers, and a
decision at 16 workers is fast enough to run every interval."""

from __future__ import annotations

import time

from services.common.config import ClusterConfig, parse_config
from services.planner.capacity import Capacity
from services.planner.decision import Action, Split
from services.planner.forecast import Load
from services.planner.forward import Start, run_forward
from services.planner.lookahead import SimulatePolicy
from services.planner.signals import ClusterSignals, IntervalStats, Role, WorkerSignals
from services.steptime.model import MockStepModel


def cfg(*overrides: str) -> ClusterConfig:
    return parse_config({}, ["engine.runner=mock", "decode.disagg.enabled=true",
                             "decode.disagg.max_local_prefill_length=256",
                             "planner.max_total_workers=16", "planner.max_prefill=15",
                             "planner.max_decode=15", "planner.min_prefill=1",
                             "planner.cooldown_s=0", *overrides])


def cap(c: ClusterConfig) -> Capacity:
    return Capacity.of(c, MockStepModel.of(c.engine.mock))


def predict(c: ClusterConfig, split: Split, load: Load, start: Start | None = None) -> float:
    s = start or Start(split.prefill, split.decode, split)
    return run_forward(s, split, [load] * 3, cap(c), c.planner).goodput


PREFILL_HEAVY = Load(4.0, 700, 40)
DECODE_HEAVY = Load(2.5, 360, 1500)


def test_prefill_heavy_load_wants_prefill_workers() -> None:
    c = cfg()
    assert predict(c, Split(6, 2), PREFILL_HEAVY) > 0.9
    assert predict(c, Split(3, 5), PREFILL_HEAVY) < 0.5


def test_decode_heavy_load_wants_decode_workers() -> None:
    c = cfg()
    assert predict(c, Split(2, 6), DECODE_HEAVY) > 0.9
    assert predict(c, Split(6, 2), DECODE_HEAVY) < predict(c, Split(2, 6), DECODE_HEAVY)


def test_a_backlog_lowers_the_prediction_and_more_prefill_clears_it() -> None:
    c = cfg()
    now = Split(3, 2)
    backlog = Start(3, 2, now, queue_tokens=15_000, queue_jobs=22, queue_oldest_wait_s=3.0)
    calm = predict(c, Split(3, 2), PREFILL_HEAVY, Start(3, 2, now))
    assert predict(c, Split(3, 2), PREFILL_HEAVY, backlog) < calm
    assert predict(c, Split(7, 2), PREFILL_HEAVY, backlog) > predict(
        c, Split(3, 2), PREFILL_HEAVY, backlog)


def test_ready_time_is_charged() -> None:
    now = Split(3, 2)
    start = Start(3, 2, now)
    fast = predict(cfg("planner.worker_ready_s=0"), Split(6, 2), PREFILL_HEAVY, start)
    slow = predict(cfg("planner.worker_ready_s=25"), Split(6, 2), PREFILL_HEAVY, start)
    assert fast > slow


def _signals(t: float, load: Load, split: Split) -> ClusterSignals:
    workers = tuple([WorkerSignals(f"p{i}", Role.PREFILL) for i in range(split.prefill)]
                    + [WorkerSignals(f"d{i}", Role.DECODE, kv_blocks_total=2048)
                       for i in range(split.decode)])
    last = IntervalStats(duration_s=10.0, arrivals=round(load.rate * 10),
                         mean_input_tokens=load.input_tokens,
                         mean_output_tokens=load.output_tokens)
    return ClusterSignals(t=t, workers=workers, last=last)


def test_policy_moves_toward_the_split_that_serves_the_load() -> None:
    c = cfg("planner.max_total_workers=8", "planner.max_prefill=7", "planner.max_decode=7")
    pol = SimulatePolicy(c.planner, cap(c))
    split = Split(2, 6)
    for i in range(8):
        d = pol.decide(_signals(10.0 * (i + 1), PREFILL_HEAVY, split), split)
        assert d.reason and d.desired.total <= 8
        split = d.desired
    assert split.prefill >= 5


def test_idle_cluster_shrinks_to_the_minimum() -> None:
    """Once its traffic stops; before any traffic it holds (no_data)."""
    c = cfg()
    pol = SimulatePolicy(c.planner, cap(c))
    split = Split(4, 4)
    first = pol.decide(_signals(10.0, Load(0.0, 500, 100), split), split)
    assert first.action is Action.HOLD and first.reason == "no_data"
    pol.decide(_signals(20.0, Load(0.5, 500, 100), split), split)
    for i in range(12):
        d = pol.decide(_signals(10.0 * (i + 3), Load(0.0, 500, 100), split), split)
        split = d.desired
    assert split == Split(1, 1)


def test_no_data_holds() -> None:
    c = cfg()
    d = SimulatePolicy(c.planner, cap(c)).decide(ClusterSignals(t=0.0), Split(2, 2))
    assert d.action is Action.HOLD and d.reason == "no_data"


def test_decision_at_16_workers_is_fast() -> None:
    c = cfg("planner.lookahead_intervals=6")
    pol = SimulatePolicy(c.planner, cap(c))
    split = Split(8, 8)
    load = Load(8.0, 700, 200)
    pol.decide(_signals(10.0, load, split), split)
    t0 = time.perf_counter()
    for i in range(5):
        pol.decide(_signals(20.0 + 10 * i, load, split), split)
    per = (time.perf_counter() - t0) / 5
    assert per < 0.5, per  # measured ~10-40 ms on a shared 2-core machine


def test_an_overloaded_cluster_is_never_shrunk() -> None:
    """Far more load than the budget serves: every split predicts ~0 goodput, so the
    fewer-workers tie-break would release workers (with real processes it drained an
    overloaded cluster to 1P/1D). Fewer workers need a prediction that they meet the
    targets; the total in use never falls."""
    c = cfg("planner.max_total_workers=8", "planner.max_prefill=7", "planner.max_decode=7")
    pol = SimulatePolicy(c.planner, cap(c))
    split, flood = Split(4, 4), Load(400.0, 700, 1500)
    reasons = set()
    for i in range(15):
        d = pol.decide(_signals(10.0 * (i + 1), flood, split), split)
        assert d.desired.total >= split.total, d
        reasons.add(d.reason)
        split = d.desired
    assert "overloaded" in reasons


def test_a_shift_that_works_off_a_backlog_goes_at_once() -> None:
    """A prompt surge: every split predicts the same (near-0) goodput, and more prefill
    workers leave fewer requests waiting at the horizon. That shift goes at once; held as
    a tie-break (a window) it lost most of a prefill-heavy phase (tandem sim planner-eval's
    grid, docs/benchmarks.md "Planner")."""
    import dataclasses

    c = cfg("planner.max_total_workers=4", "planner.max_prefill=3", "planner.max_decode=3")
    pol = SimulatePolicy(c.planner, cap(c))
    split = Split(1, 3)
    s = dataclasses.replace(_signals(10.0, Load(6.0, 700, 40), split), prefill_queue_jobs=300,
                            prefill_queue_tokens=210_000, prefill_queue_oldest_wait_s=60.0)
    d = pol.decide(s, split)
    assert d.reason == "lookahead_backlog" and d.action is Action.REBALANCE
    assert d.desired.prefill > split.prefill and d.desired.total == split.total


def test_a_tie_hedges_toward_the_load_seen_before() -> None:
    """After long outputs, long prompts: 7P/1D and 6P/2D both serve the prompts, but 6P/2D
    would serve the long outputs of a minute ago far better. With the hedge the tie goes to
    6P/2D; without (hedge_window_s 0) the split now keeps it."""
    prompts = Load(2.5, 700, 40)
    moves = {}
    for window in (300, 0):
        c = cfg("planner.max_total_workers=8", "planner.max_prefill=7",
                "planner.max_decode=7", f"planner.hedge_window_s={window}")
        pol = SimulatePolicy(c.planner, cap(c))
        t = 0.0
        for _ in range(6):
            t += 10.0
            pol.decide(_signals(t, DECODE_HEAVY, Split(3, 5)), Split(3, 5))
        for _ in range(4):  # the forecast forgets the long outputs
            t += 10.0
            pol.decide(_signals(t, prompts, Split(7, 1)), Split(7, 1))
        moves[window] = pol.decide(_signals(t + 10.0, prompts, Split(7, 1)), Split(7, 1))
    assert moves[300].reason == "lookahead_hedge" and moves[300].desired == Split(6, 2)
    assert moves[0].desired == Split(7, 1)


def test_a_steady_load_never_hedges() -> None:
    """One load throughout: the recent extremes are that load, so nothing hedges."""
    c = cfg("planner.max_total_workers=8", "planner.max_prefill=7", "planner.max_decode=7")
    pol = SimulatePolicy(c.planner, cap(c))
    split = Split(4, 4)
    for i in range(20):
        d = pol.decide(_signals(10.0 * (i + 1), Load(2.0, 500, 300), split), split)
        assert d.reason != "lookahead_hedge", d
        split = d.desired
