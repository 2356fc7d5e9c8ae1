"""A policy, collector and actuator small enough to read at a glance, for the loop's tests
(the real policies are services/planner/{formula,lookahead}.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.config import PlannerConfig
from services.planner.decision import Action, Decision, Split
from services.planner.signals import ClusterSignals, IntervalStats


@dataclass
class QueuePolicy:
    """One more decode worker while the prefill queue holds more than ``tokens``."""

    tokens: int = 1000
    seen: list[Split] = field(default_factory=list)

    def decide(self, signals: ClusterSignals, current: Split) -> Decision:
        self.seen.append(current)
        if signals.prefill_queue_tokens > self.tokens:
            return Decision(signals.t, current, Split(current.prefill, current.decode + 1),
                            Action.SCALE_UP, "queue")
        return Decision(signals.t, current, current, Action.HOLD, "steady")


@dataclass
class ScriptedCollector:
    queue_tokens: list[int]
    t: float = 0.0

    async def collect(self) -> ClusterSignals:
        self.t += 10.0
        tokens = self.queue_tokens.pop(0) if self.queue_tokens else 0
        return ClusterSignals(t=self.t, prefill_queue_tokens=tokens,
                              last=IntervalStats(duration_s=10.0, arrivals=50, ttft_p90_s=0.5))


@dataclass
class MemoryActuator:
    split: Split
    applied: list[Split] = field(default_factory=list)
    fail: bool = False

    async def current(self) -> Split:
        return self.split

    async def apply(self, desired: Split) -> None:
        if self.fail:
            raise RuntimeError("the endpoint refused")
        self.applied.append(desired)
        self.split = desired


@dataclass
class OneMoreDecode:
    """Asks once for one more decode worker, then holds (`tandem planner`'s policy in the
    launcher's integration test, through TANDEM_PLANNER_POLICY)."""

    asked: bool = False

    def decide(self, signals: ClusterSignals, current: Split) -> Decision:
        if self.asked:
            return Decision(signals.t, current, current, Action.HOLD, "steady")
        self.asked = True
        return Decision(signals.t, current, Split(current.prefill, current.decode + 1),
                        Action.SCALE_UP, "one_more")


def one_more_decode(_pc: PlannerConfig) -> OneMoreDecode:
    return OneMoreDecode()
