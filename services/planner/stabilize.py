"""Scale up at once, down only when the load has stayed down: a role shrinks only as far as
every recommendation of the last ``planner.scale_down_window_s`` allows (the stabilization
window of Kubernetes' HorizontalPodAutoscaler), and decode never below the seats its
requests in flight need. Both policies apply it in ``FormulaPolicy.gate``, before the
cooldown, so the cooldown counts only changes made.

Why (benchmarks/planner_live.py, real processes): the policies alone drained a fresh
cluster to 1 + 1 on the partial first interval of traffic, swung whole roles back and forth
under the backlog that left (1P/7D -> 6P/1D -> 2P/6D within a minute), and after the last
arrival (an empty forecast) drained 3 of 4 loaded decode workers into the fourth, which
refused what it could not queue."""

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

    def limit(self, t: float, current: Split, want: Split, signals: ClusterSignals | None = None) -> Split:
        """``want`` as far as the window allows; records it as this interval's recommendation.
        The first call counts the split running then as a recommendation too: a planner
        just started shrinks nothing before a whole window of evidence."""
        if not self._recent and self.window_s > 0:
            self._recent.append((t, current))
        self._recent.append((t, want))
        while self._recent and self._recent[0][0] < t - self.window_s:
            self._recent.popleft()
        decode = want.decode if want.decode >= current.decode else min(
            current.decode, max(s.decode for _, s in self._recent))
        prefill = want.prefill if want.prefill >= current.prefill else min(
            current.prefill, max(s.prefill for _, s in self._recent))
        if decode < current.decode and signals is not None and self.seats:
            # a drained decode worker moves its requests to the others
            flight = sum(w.requests_running + w.requests_waiting for w in signals.workers if w.role is Role.DECODE)
            decode = min(current.decode, max(decode, -(-flight // self.seats)))
        # a role kept up leaves less of the budget to the other's growth
        if prefill + decode > self.max_total:
            if want.prefill > current.prefill:
                prefill = max(current.prefill, self.max_total - decode)
            if want.decode > current.decode:
                decode = max(current.decode, self.max_total - prefill)
        return Split(prefill, decode)
