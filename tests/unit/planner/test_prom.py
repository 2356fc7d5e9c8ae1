from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from services.planner.prom import add_buckets, bucket_delta, delta, parse, quantile


def test_parse_sums_label_sets_and_keeps_cumulative_buckets() -> None:
    r = CollectorRegistry()
    c = Counter("x_total", "x", ["outcome"], registry=r)
    c.labels("stop").inc(3)
    c.labels("length").inc(2)
    h = Histogram("lat_seconds", "l", buckets=(0.1, 1.0), registry=r)
    for v in (0.05, 0.5, 0.5, 5.0):
        h.observe(v)
    s = parse(generate_latest(r).decode())
    assert s.get("x_total") == 5.0
    assert s.buckets["lat_seconds"] == {0.1: 1.0, 1.0: 3.0, math.inf: 4.0}
    assert s.get("lat_seconds_count") == 4.0


def test_quantile_interpolates_like_prometheus() -> None:
    cum = {0.1: 10.0, 1.0: 20.0, math.inf: 20.0}
    assert quantile(0.5, cum) == 0.1
    assert math.isclose(quantile(0.9, cum), 0.1 + 0.9 * 0.8)
    assert quantile(0.9, {0.1: 0.0, math.inf: 0.0}) is None
    assert quantile(0.99, {0.1: 0.0, 1.0: 1.0, math.inf: 5.0}) == 1.0  # in +Inf: last bound
    assert math.isclose(quantile(0.5, {1.0: 4.0, math.inf: 4.0}), 0.5)  # first bucket from 0


def test_deltas_survive_a_restarted_part() -> None:
    assert delta(10, 4) == 6 and delta(3, 10) == 3 and delta(7, None) == 0
    assert bucket_delta({1.0: 5, math.inf: 6}, {1.0: 2, math.inf: 2}) == {1.0: 3, math.inf: 4}
    assert bucket_delta({1.0: 1, math.inf: 1}, {1.0: 2, math.inf: 2}) == {1.0: 1, math.inf: 1}
    assert bucket_delta({1.0: 1}, None) == {}
    assert add_buckets([{1.0: 1, math.inf: 2}, {1.0: 3, math.inf: 3}]) == {1.0: 4, math.inf: 5}
