from __future__ import annotations

import asyncio
import math

from prometheus_client import generate_latest

from services.planner.decision import Action, Split
from services.planner.loop import ADOPTED, PlannerLoop
from tests.support.planner_fakes import MemoryActuator, QueuePolicy, ScriptedCollector


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _loop(queue: list[int], cooldown_s: float = 30.0):
    clock = Clock()
    act = MemoryActuator(Split(1, 1))
    loop = PlannerLoop(QueuePolicy(), ScriptedCollector(queue), act, interval_s=10.0,
                       cooldown_s=cooldown_s, clock=clock)
    return loop, act, clock


def _sample(loop: PlannerLoop, name: str, labels: dict[str, str] | None = None) -> float:
    v = loop.metrics.registry.get_sample_value(name, labels or {})
    assert v is not None, name
    return v


async def test_a_changed_split_is_applied_and_a_hold_is_not() -> None:
    loop, act, _ = _loop([5000, 0])
    d = await loop.step()
    assert (d.action, d.desired) == (Action.SCALE_UP, Split(1, 2))
    assert act.applied == [Split(1, 2)]
    d = await loop.step()
    assert (d.action, d.current, d.desired) == (Action.HOLD, Split(1, 2), Split(1, 2))
    assert act.applied == [Split(1, 2)]
    assert [x.reason for x in loop.decisions] == ["queue", "steady"]


async def test_decisions_signals_and_replicas_are_exported() -> None:
    loop, _, _ = _loop([5000, 0])
    await loop.step()
    await loop.step()
    assert _sample(loop, "tandem_planner_decisions_total", {"action": "scale_up", "reason": "queue"}) == 1
    assert _sample(loop, "tandem_planner_decisions_total", {"action": "hold", "reason": "steady"}) == 1
    assert _sample(loop, "tandem_planner_desired_replicas", {"role": "decode"}) == 2
    assert _sample(loop, "tandem_planner_actual_replicas", {"role": "decode"}) == 2
    assert _sample(loop, "tandem_planner_actual_replicas", {"role": "prefill"}) == 1
    assert _sample(loop, "tandem_planner_arrival_rate") == 5.0
    assert _sample(loop, "tandem_planner_ttft_p90_seconds") == 0.5
    assert math.isnan(_sample(loop, "tandem_planner_itl_p90_seconds"))
    text = generate_latest(loop.metrics.registry).decode()
    assert "tandem_planner_prefill_queue_tokens 0.0" in text


async def test_a_split_changed_by_hand_is_adopted_for_the_cooldown() -> None:
    loop, act, clock = _loop([0, 5000, 5000, 5000], cooldown_s=30.0)
    await loop.step()
    act.split = Split(2, 3)  # someone scaled by hand between two rounds
    clock.t = 10.0
    d = await loop.step()
    assert (d.action, d.reason, d.current, d.desired) == (Action.HOLD, ADOPTED, Split(2, 3), Split(2, 3))
    assert "outside the planner" in d.detail and act.applied == []
    assert loop._policy.seen[-1] == Split(2, 3)  # the policy saw the adopted split
    clock.t = 30.0
    assert (await loop.step()).reason == ADOPTED
    clock.t = 40.0  # the cooldown after the hand change is over: the policy's wish goes
    d = await loop.step()
    assert (d.action, d.desired) == (Action.SCALE_UP, Split(2, 4))
    assert act.applied == [Split(2, 4)]
    assert _sample(loop, "tandem_planner_adopted_changes_total") == 1


async def test_a_failed_apply_is_counted_and_not_taken_for_a_hand_change() -> None:
    loop, act, _ = _loop([5000, 0])
    act.fail = True
    d = await loop.step()
    assert d.action is Action.SCALE_UP and act.split == Split(1, 1)
    assert _sample(loop, "tandem_planner_apply_errors_total") == 1
    act.fail = False
    d = await loop.step()
    assert d.reason == "steady"  # not "adopted": the loop did not know what it left


async def test_run_steps_every_interval_until_stopped() -> None:
    loop, act, _ = _loop([5000, 5000, 5000, 5000, 5000])
    loop._interval_s = 0.05
    stop = asyncio.Event()
    task = asyncio.create_task(loop.run(stop))
    await asyncio.sleep(0.12)
    stop.set()
    await asyncio.wait_for(task, 1.0)
    assert 2 <= len(act.applied) <= 4
    assert act.split.decode == 1 + len(act.applied)


async def test_an_actuator_that_applies_nothing_is_not_taken_for_a_hand_change() -> None:
    class Observe(MemoryActuator):
        async def apply(self, desired: Split) -> None:
            self.applied.append(desired)  # noted, not carried out (planner.actuator=observe)

    loop = PlannerLoop(QueuePolicy(), ScriptedCollector([5000, 5000]), Observe(Split(1, 1)),
                       interval_s=10.0, cooldown_s=30.0, clock=Clock())
    assert (await loop.step()).desired == Split(1, 2)
    d = await loop.step()
    assert (d.action, d.reason, d.desired) == (Action.SCALE_UP, "queue", Split(1, 2))
