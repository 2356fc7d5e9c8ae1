"""Scale up at once, release workers only when the load has stayed down: the budget in use
shrinks only as far as every recommendation of the last ``planner.scale_down_window_s``
allows (the stabilization window of Kubernetes' HorizontalPodAutoscaler); a shift of
workers from one role to the other goes ahead at once when the policy predicts it raises
goodput (or, where every split predicts the same, fewer requests waiting); a shift only
the fewer-workers tie-break chose is held as a release is; and decode never shrinks
below the seats its requests in flight need. Both policies apply it in
``FormulaPolicy.gate``, before the cooldown, so the cooldown counts only changes made.

Why (benchmarks/planner_live.py, real processes): the policies alone drained a fresh
cluster to 1 + 1 on the partial first interval of traffic, swung whole roles back and forth
on tie-breaks under the backlog that left (1P/7D -> 6P/1D -> 2P/6D within a minute), and
after the last arrival (an empty forecast) drained 3 of 4 loaded decode workers into the
fourth, which refused what it could not queue.

Why a shift is not held as a release is (tandem sim planner-eval, 16 workers): when the
load's shape changes, the role that shrinks funds the other's growth. Holding each role
for a window then held the growing role too, a whole window behind every phase change
(0.68 goodput against 0.91 with no window at all), and held a move that came in two steps
(the forecast follows a step in two or three intervals) at its first. Nor is a role that
grew within the window held (an earlier rule against swings): a phase change soon after a
move then waited out the window, and over a grid of budgets, phase lengths and seeds
(docs/benchmarks.md "Planner") the planner matched the best fixed split in 5 of 12 cases
with it and 9 of 12 without."""

from __future__ import annotations

from collections import deque

from services.planner.decision import Split
from services.planner.signals import ClusterSignals, Role


class ScaleDownWindow:
    def __init__(self, window_s: float, max_total: int, seats: int) -> None:
        self.window_s = window_s
        self.max_total = max_total
        self.seats = seats  # engine.max_num_seqs: a decode worker's running requests at most
        self._recent: deque[tuple[float, Split]] = deque()

    def limit(self, t: float, current: Split, want: Split,
              signals: ClusterSignals | None = None, shift_now: bool = True) -> Split:
        """``want`` as far as the window allows; records it as this interval's recommendation.
        The first call counts the split running then as a recommendation too: a planner
        just started releases nothing before a whole window of evidence."""
        self.record(t, current, want)
        p, d = want.prefill, want.decode
        if p >= current.prefill and d >= current.decode:
            return self._seated(Split(p, d), current, signals)
        if p <= current.prefill and d <= current.decode:
            # a release: each role only as far as every recommendation of the window allowed
            low = self._floor(current)
            return self._seated(Split(max(low.prefill, p), max(low.decode, d)), current, signals)
        # a shift: one role grows at once from the other; workers beyond the shift are
        # released as a release is
        to_prefill = p > current.prefill
        if not shift_now:
            # a shift only a tie-break toward fewer workers asks for: the shrinking role is
            # held as a release is, and the growing one gets only what that leaves of the budget
            low = self._floor(current)
            if to_prefill:
                d = max(d, low.decode)
                p = max(current.prefill, min(p, self.max_total - d))
            else:
                p = max(p, low.prefill)
                d = max(current.decode, min(d, self.max_total - p))
            return self._seated(Split(p, d), current, signals)
        floor = min(current.total, max(s.total for _, s in self._recent))
        if p + d < floor:
            if to_prefill:
                d = min(current.decode, floor - p)
            else:
                p = min(current.prefill, floor - d)
        return self._seated(Split(p, d), current, signals)

    def record(self, t: float, current: Split, want: Split) -> None:
        """This interval's recommendation (a policy's hold is one too: ``want`` = current)."""
        if not self._recent and self.window_s > 0:
            self._recent.append((t, current))
        self._recent.append((t, want))
        while self._recent and self._recent[0][0] < t - self.window_s:
            self._recent.popleft()

    def _floor(self, current: Split) -> Split:
        """The lowest each role may be released to: no lower than every recommendation of
        the window asked for, and never above what runs now."""
        return Split(min(current.prefill, max(s.prefill for _, s in self._recent)),
                     min(current.decode, max(s.decode for _, s in self._recent)))

    def _seated(self, kept: Split, current: Split, signals: ClusterSignals | None) -> Split:
        """Decode no lower than the seats its requests in flight need (a drained decode
        worker moves its requests to the others); prefill gives way within the budget."""
        p, d = kept.prefill, kept.decode
        if d < current.decode and signals is not None and self.seats:
            flight = sum(w.requests_running + w.requests_waiting for w in signals.workers
                         if w.role is Role.DECODE)
            d = min(current.decode, max(d, -(-flight // self.seats)))
            if p + d > self.max_total:
                p = max(min(p, current.prefill), self.max_total - d)
        return Split(p, d)
