"""The planner's reconcile loop: every ``planner.interval_s`` read the signals and the split
the actuator reports, ask the policy for a split, and apply it when it differs.

The policy owns the targets, the bounds and its own cooldown (services/planner/policy.py);
the loop owns what only it can see: a split changed by someone else between two of its
rounds (a hand-scaled Deployment, a worker started by hand). That change is adopted, not
fought: it becomes the current split and nothing is applied for ``cooldown_s`` after it,
as Kubernetes' HPA treats a hand change. One log line and one metric per decision.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

from services.planner.actuator import Actuator
from services.planner.decision import Action, Decision, Split
from services.planner.metrics import PlannerMetrics
from services.planner.policy import Policy
from services.planner.signals import ClusterSignals

log = logging.getLogger("tandem.planner")

ADOPTED = "adopted"  # the reason of a hold after a change made by someone else


class Collector(Protocol):
    async def collect(self) -> ClusterSignals:
        """One snapshot of the cluster, its ``last`` interval ending now."""
        ...


class PlannerLoop:
    def __init__(self, policy: Policy, collector: Collector, actuator: Actuator, *,
                 interval_s: float, cooldown_s: float, metrics: PlannerMetrics | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._policy, self._collector, self._actuator = policy, collector, actuator
        self._interval_s, self._cooldown_s = interval_s, cooldown_s
        self.metrics = metrics if metrics is not None else PlannerMetrics()
        self._clock = clock
        # what the loop last left the cluster at (None: not known, e.g. after a failed apply)
        self._expected: Split | None = None
        self._hold_until = float("-inf")
        self.decisions: list[Decision] = []  # NOTE: kept for tests and `--once`; bounded below

    async def step(self) -> Decision:
        """One round: collect, decide, apply. Returns the decision as carried out."""
        signals = await self._collector.collect()
        current = await self._actuator.current()
        now = self._clock()
        adopted = self._expected is not None and current != self._expected
        if adopted:
            self.metrics.adopted.inc()
            self._hold_until = now + self._cooldown_s
            log.info("planner: the split went from %s to %s outside the planner: adopted, no "
                     "change for %g s", _fmt(self._expected), _fmt(current), self._cooldown_s)
        self._expected = current
        decision = self._policy.decide(signals, current)
        if decision.desired != current and now < self._hold_until:
            decision = replace(decision, desired=current, action=Action.HOLD, reason=ADOPTED,
                               detail=f"the split was changed to {_fmt(current)} outside the "
                                      f"planner; holding {self._hold_until - now:.0f} s "
                                      f"(policy wanted {_fmt(decision.desired)}: {decision.reason})")
        if decision.desired != current:
            try:
                await self._actuator.apply(decision.desired)
                # NOTE: read back, not assumed: an observe-only actuator changes nothing,
                # and what it reports next round must not look like a hand change
                self._expected = await self._actuator.current()
            except Exception as e:  # an API or endpoint refusal: the next round reads back
                self._expected = None
                self.metrics.apply_errors.inc()
                log.warning("planner: applying %s failed: %s", _fmt(decision.desired), e)
        self.metrics.record(signals, decision)
        log.info("planner: %s %s -> %s (%s)%s", decision.action.value, _fmt(current),
                 _fmt(decision.desired), decision.reason,
                 f": {decision.detail}" if decision.detail else "")
        self.decisions.append(decision)
        del self.decisions[:-64]
        return decision

    async def run(self, stop: asyncio.Event) -> None:
        """A round every ``interval_s`` until ``stop`` is set; a failed round (NATS or a
        scrape timing out) is logged and the next one tried."""
        next_at = time.monotonic()
        while not stop.is_set():
            try:
                await self.step()
            except Exception as e:
                log.warning("planner: round failed: %s: %s", type(e).__name__, e)
            next_at += self._interval_s
            delay = max(0.0, next_at - time.monotonic())
            if delay == 0.0:
                next_at = time.monotonic()  # a slow round: do not try to catch up
            try:
                await asyncio.wait_for(stop.wait(), delay)
            except TimeoutError:
                pass


def _fmt(s: Split) -> str:
    return f"{s.prefill}P/{s.decode}D"
