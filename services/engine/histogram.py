"""A Prometheus-style histogram kept as plain numbers by the thread that does the work and
read by a collector at scrape time (``stats_metrics``): no locks, no allocation to observe."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field


@dataclass(slots=True)
class Histogram:
    """Cumulative-on-read bucket counts; ``observe`` is O(log buckets), no allocation.

    NOTE: a scrape racing an ``observe`` may see the count one ahead of the sum; the next
    scrape is exact (one writer thread per histogram)."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, v)] += 1
        self.total += v

    @property
    def count(self) -> int:
        return sum(self.counts)

    def buckets(self) -> list[tuple[str, int]]:
        out, acc = [], 0
        for b, c in zip((*map(str, self.bounds), "+Inf"), self.counts, strict=True):
            acc += c
            out.append((b, acc))
        return out
