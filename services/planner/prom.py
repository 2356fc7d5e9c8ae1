"""Reading the parts' Prometheus /metrics for the planner: one scrape parsed into plain
numbers, and what one interval added to a counter or a histogram (docs/planner.md, "Each
signal and where it comes from")."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True, slots=True)
class Scrape:
    """One part's /metrics: sample name -> value summed over its label sets, and each
    histogram's cumulative buckets (upper bound -> count) summed over its label sets."""

    values: Mapping[str, float] = field(default_factory=dict)
    buckets: Mapping[str, Mapping[float, float]] = field(default_factory=dict)

    def get(self, name: str) -> float:
        return self.values.get(name, 0.0)


def parse(text: str) -> Scrape:
    values: dict[str, float] = {}
    buckets: dict[str, dict[float, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith("_bucket") and "le" in s.labels:
                h = buckets.setdefault(s.name[: -len("_bucket")], {})
                le = float(s.labels["le"])
                h[le] = h.get(le, 0.0) + s.value
            else:
                values[s.name] = values.get(s.name, 0.0) + s.value
    return Scrape(values, buckets)


async def scrape(client: httpx.AsyncClient, address: str) -> Scrape | None:
    """``http://address/metrics`` parsed; None when the part does not answer (it is
    starting or going away: its interval is left out)."""
    try:
        r = await client.get(f"http://{address}/metrics")
        r.raise_for_status()
    except httpx.HTTPError:
        return None
    return parse(r.text)


def delta(now: float, before: float | None) -> float:
    """What a counter added since ``before``; a counter that went down was restarted, so
    all of ``now`` is new; no ``before`` (a part first seen) adds nothing yet."""
    if before is None:
        return 0.0
    return now - before if now >= before else now


def bucket_delta(now: Mapping[float, float], before: Mapping[float, float] | None) -> dict[float, float]:
    if before is None:
        return {}
    if any(now.get(le, 0.0) < v for le, v in before.items()):  # restarted
        return dict(now)
    return {le: v - before.get(le, 0.0) for le, v in now.items()}


def add_buckets(parts: Iterable[Mapping[float, float]]) -> dict[float, float]:
    out: dict[float, float] = {}
    for p in parts:
        for le, v in p.items():
            out[le] = out.get(le, 0.0) + v
    return out


def quantile(q: float, cumulative: Mapping[float, float]) -> float | None:
    """Prometheus' ``histogram_quantile``: linear inside the bucket the rank falls in
    (the first bucket from 0); the last finite bound when it falls in +Inf. None when
    the histogram counted nothing."""
    bounds: Sequence[float] = sorted(cumulative)
    if not bounds or cumulative[bounds[-1]] <= 0:
        return None
    total = cumulative[bounds[-1]]
    rank = q * total
    lower, below = 0.0, 0.0
    for le in bounds:
        count = cumulative[le]
        if count >= rank:
            if math.isinf(le):
                return lower
            inside = count - below
            return le if inside <= 0 else lower + (le - lower) * (rank - below) / inside
        lower, below = le, count
    return lower
