"""When each request is sent: a schedule of send offsets (seconds from the start), or a
fixed concurrency (no schedule: the runner keeps N requests in flight).

Every schedule is bounded: at most ``max_requests`` entries and none past ``duration_s``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

ArrivalKind = Literal["poisson", "gamma", "concurrency", "trace"]


@dataclass(frozen=True)
class ArrivalSpec:
    """``rate``: requests/s (poisson, gamma). ``burstiness``: the gamma shape (1 = Poisson,
    < 1 burstier; vLLM's convention). ``concurrency``: requests in flight (concurrency).
    ``speedup``: trace timestamps are divided by it (trace)."""

    kind: ArrivalKind
    rate: float = 1.0
    burstiness: float = 1.0
    concurrency: int = 1
    speedup: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("poisson", "gamma", "concurrency", "trace"):
            raise ValueError(f"arrivals: unknown kind {self.kind!r}")
        if self.kind in ("poisson", "gamma") and not self.rate > 0:
            raise ValueError(f"arrivals: rate must be > 0, got {self.rate}")
        if self.kind == "gamma" and not self.burstiness > 0:
            raise ValueError(f"arrivals: burstiness must be > 0, got {self.burstiness}")
        if self.kind == "concurrency" and self.concurrency < 1:
            raise ValueError(f"arrivals: concurrency must be >= 1, got {self.concurrency}")
        if self.kind == "trace" and not self.speedup > 0:
            raise ValueError(f"arrivals: speedup must be > 0, got {self.speedup}")


def schedule(spec: ArrivalSpec, max_requests: int, duration_s: float | None = None,
             trace_s: Sequence[float | None] = ()) -> list[float] | None:
    """Send offsets for the first requests, ascending; None for ``concurrency``.

    poisson/gamma: the first request at 0, then exponential (gamma with shape
    ``burstiness`` and mean ``1/rate``) gaps. trace: ``trace_s[i] / speedup``, relative
    to the first entry.
    """
    if max_requests < 0:
        raise ValueError(f"arrivals: max_requests must be >= 0, got {max_requests}")
    if spec.kind == "concurrency":
        return None
    if spec.kind == "trace":
        stamps = list(trace_s[:max_requests])
        if any(t is None for t in stamps):
            raise ValueError("arrivals: trace arrivals need a workload with timestamps "
                             "(mooncake or azure)")
        base = stamps[0] if stamps else 0.0
        times = [(t - base) / spec.speedup for t in stamps]  # type: ignore[operator]
        if any(b < a for a, b in zip(times, times[1:], strict=False)):
            raise ValueError("arrivals: trace timestamps are not in ascending order")
    else:
        rng = np.random.default_rng(spec.seed)
        shape = 1.0 if spec.kind == "poisson" else spec.burstiness
        gaps = rng.gamma(shape, 1.0 / (spec.rate * shape), size=max(0, max_requests - 1))
        times = [0.0, *np.cumsum(gaps).tolist()][:max_requests]
    if duration_s is not None:
        times = [t for t in times if t <= duration_s]
    return times
