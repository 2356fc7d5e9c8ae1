"""The formula policy's sizing: long prompts ask for prefill, long outputs for decode,
bounds and budget hold, the cooldown holds a change, a steady load does not flap."""

from __future__ import annotations

from services.common.config import ClusterConfig, parse_config
from services.planner.capacity import Capacity
from services.planner.decision import Action, Split
from services.planner.formula import FormulaPolicy
from services.planner.signals import ClusterSignals, IntervalStats
from services.steptime.model import MockStepModel


def cfg(*overrides: str) -> ClusterConfig:
    return parse_config({}, ["engine.runner=mock", "decode.disagg.enabled=true",
                             "decode.disagg.max_local_prefill_length=256",
                             "planner.max_total_workers=16", "planner.max_prefill=12",
                             "planner.max_decode=12", "planner.min_prefill=1",
                             "planner.ttft_p90_s=2.0", "planner.itl_p90_s=0.1",
                             "planner.cooldown_s=30", "planner.interval_s=10",
                             "planner.scale_down_window_s=0", *overrides])  # the window: test_planner_stabilize


def policy(c: ClusterConfig) -> FormulaPolicy:
    return FormulaPolicy(c.planner, Capacity.of(c, MockStepModel.of(c.engine.mock)))


def signals(t: float, rate: float, inp: float, out: float, **kw: float) -> ClusterSignals:
    last = IntervalStats(duration_s=10.0, arrivals=round(rate * 10), mean_input_tokens=inp,
                         mean_output_tokens=out)
    return ClusterSignals(t=t, last=last, **kw)  # type: ignore[arg-type]


def settle(p: FormulaPolicy, rate: float, inp: float, out: float, start: Split,
           steps: int = 12, t0: float = 0.0) -> Split:
    split = start
    for i in range(steps):
        d = p.decide(signals(t0 + 10.0 * (i + 1), rate, inp, out), split)
        assert d.reason
        split = d.desired
    return split


def test_no_data_holds() -> None:
    d = policy(cfg()).decide(ClusterSignals(t=0.0), Split(2, 2))
    assert d.action is Action.HOLD and d.reason == "no_data" and d.desired == Split(2, 2)


def test_long_prompts_ask_for_more_prefill() -> None:
    c = cfg("planner.cooldown_s=0")
    short = settle(policy(c), 2.0, 1000, 50, Split(2, 2))
    long = settle(policy(c), 2.0, 4000, 50, Split(2, 2))
    assert long.prefill > short.prefill
    # 2/s x 4000 tokens at the mock's ~660 tokens/s per worker and u = 0.8: 16 workers
    # wanted, 12 allowed
    assert long.prefill == 12


def test_long_outputs_ask_for_more_decode() -> None:
    c = cfg("planner.cooldown_s=0")
    short = settle(policy(c), 4.0, 100, 50, Split(1, 2))
    long = settle(policy(c), 4.0, 100, 800, Split(1, 2))
    assert long.decode > short.decode


def test_short_prompts_need_no_prefill_worker_beyond_the_minimum() -> None:
    c = cfg("planner.cooldown_s=0")
    assert settle(policy(c), 4.0, 100, 200, Split(4, 2)).prefill == 1


def test_bounds_and_budget_hold() -> None:
    c = cfg("planner.cooldown_s=0", "planner.max_total_workers=8", "planner.max_prefill=6",
            "planner.max_decode=6")
    s = settle(policy(c), 20.0, 4000, 800, Split(2, 2))
    assert s.total <= 8 and s.prefill <= 6 and s.decode <= 6
    assert s.prefill >= 1 and s.decode >= 1
    # a cluster that never saw traffic holds what it was given; one whose traffic stopped
    # goes down to the minimum
    assert settle(policy(c), 0.0, 4000, 800, Split(5, 3)) == Split(5, 3)
    seen = policy(c)
    busy = settle(seen, 20.0, 4000, 800, Split(2, 2))
    assert settle(seen, 0.0, 4000, 800, busy, t0=120.0) == Split(1, 1)


def test_cooldown_holds_a_second_change() -> None:
    p = policy(cfg("planner.cooldown_s=30"))
    first = p.decide(signals(10.0, 2.0, 4000, 50), Split(1, 1))
    assert first.action is not Action.HOLD
    again = p.decide(signals(20.0, 0.1, 100, 50), first.desired)
    assert again.action is Action.HOLD and again.reason == "cooldown"
    later = p.decide(signals(50.0, 0.1, 100, 50), first.desired)
    assert later.action is not Action.HOLD


def test_queue_wait_past_the_target_adds_prefill() -> None:
    from services.planner.signals import Role, WorkerSignals
    p = policy(cfg("planner.cooldown_s=0"))
    workers = (WorkerSignals("p0", Role.PREFILL), WorkerSignals("d0", Role.DECODE),
               WorkerSignals("d1", Role.DECODE))
    d = p.decide(signals(10.0, 0.5, 1000, 50, prefill_queue_jobs=3,
                         prefill_queue_tokens=100, prefill_queue_oldest_wait_s=5.0,
                         workers=workers), Split(1, 2))
    assert d.desired.prefill == 2 and d.reason.startswith("queue_wait")


def test_steady_noisy_load_does_not_flap() -> None:
    p = policy(cfg("planner.cooldown_s=0"))
    split = Split(1, 1)
    changes = []
    for i in range(40):
        rate = 1.5 * (1.1 if i % 2 else 0.9)  # +-10% noise around a steady load
        d = p.decide(signals(10.0 * (i + 1), rate, 2000, 100), split)
        if d.desired != split:
            changes.append(i)
        split = d.desired
    assert changes and max(changes) < 6  # it settles, then holds
