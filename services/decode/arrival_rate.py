"""How many requests a second reach a decode worker lately: what the remote-prefill
decision prices a local prefill's wait for (services/decode/disagg.py)."""

from __future__ import annotations

import math

# NOTE: long enough that a Poisson stream of ~1 req/s reads steadily (about 20 arrivals
# in the count), short enough to follow a load that shifts within a minute.
HORIZON_S = 20.0


class ArrivalRate:
    """An exponentially decayed count of arrivals, with ``horizon_s`` its time constant:
    ``rate`` is that count over the horizon (for a steady stream of rate r, r on average
    once the worker has run a horizon or more; less before). Times are the caller's clock
    (the worker's monotonic one, the simulator's own)."""

    __slots__ = ("_horizon", "_count", "_at")

    def __init__(self, horizon_s: float = HORIZON_S) -> None:
        if horizon_s <= 0:
            raise ValueError(f"horizon_s must be > 0, got {horizon_s}")
        self._horizon = horizon_s
        self._count = 0.0
        self._at = 0.0

    def arrived(self, now: float) -> None:
        self._count = self._decayed(now) + 1.0
        self._at = now

    def rate(self, now: float) -> float:
        """Requests a second."""
        return self._decayed(now) / self._horizon

    def _decayed(self, now: float) -> float:
        if not self._count:
            return 0.0
        return self._count * math.exp(-max(now - self._at, 0.0) / self._horizon)
