"""Scale up at once, down only when the load has stayed down: a role shrinks only as far as
every recommendation of the last ``planner.scale_down_window_s`` allows (the stabilization
window of Kubernetes' HorizontalPodAutoscaler). A policy sized on one interval's
signals drained a cluster on a partial first interval and swung whole roles back and forth
under a backlog (benchmarks/planner_live.py); the window keeps each role at the most any
recent recommendation asked for, so a dip shorter than the window changes nothing."""

from __future__ import annotations

from collections import deque
from dataclasses import replace

from services.planner.bounds import action_of
from services.planner.decision import Action, Decision, Split
from services.planner.policy import Policy
from services.planner.signals import ClusterSignals, Role


class Stabilized:
    """Implements Policy around another one."""

    def __init__(self, policy: Policy, window_s: float, max_total: int, seats: int = 0) -> None:
        self.policy = policy
        self.window_s = window_s
        self.max_total = max_total
        self.seats = seats  # engine.max_num_seqs: a decode worker's running requests at most
        self._recent: deque[tuple[float, Split]] = deque()

    def decide(self, signals: ClusterSignals, current: Split) -> Decision:
        d = self.policy.decide(signals, current)
        t = signals.t
        self._recent.append((t, d.desired))
        while self._recent and self._recent[0][0] < t - self.window_s:
            self._recent.popleft()
        want = d.desired
        decode = want.decode if want.decode >= current.decode else min(
            current.decode, max(s.decode for _, s in self._recent))
        prefill = want.prefill if want.prefill >= current.prefill else min(
            current.prefill, max(s.prefill for _, s in self._recent))
        if decode < current.decode and self.seats:
            # NOTE: a drained decode worker moves its requests to the others: never fewer
            # than the requests in flight there need seats for (an empty forecast after the
            # last arrival drained 3 of 4 loaded workers into one that then refused them)
            flight = sum(w.requests_running + w.requests_waiting for w in signals.workers if w.role is Role.DECODE)
            decode = min(current.decode, max(decode, -(-flight // self.seats)))
        # a role kept up by the window leaves less of the budget to the other's growth
        if prefill + decode > self.max_total:
            if want.prefill > current.prefill:
                prefill = max(current.prefill, self.max_total - decode)
            if want.decode > current.decode:
                decode = max(current.decode, self.max_total - prefill)
        kept = Split(prefill, decode)
        if kept == want:
            return d
        if kept == current:
            return Decision(t, current, current, Action.HOLD, "stabilizing", d.detail)
        return replace(d, desired=kept, action=action_of(current, kept), reason=f"{d.reason}+stabilizing")
