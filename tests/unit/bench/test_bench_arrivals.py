"""Arrival schedules: bounded in count and time; rates right in distribution."""

from __future__ import annotations

import numpy as np
import pytest

from services.bench.arrivals import ArrivalSpec, schedule


def test_poisson_rate_and_bounds() -> None:
    times = schedule(ArrivalSpec("poisson", rate=20.0, seed=1), 4000)
    assert times is not None and len(times) == 4000 and times[0] == 0.0
    gaps = np.diff(times)
    assert np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / 20, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.08)  # exponential: CV 1
    bounded = schedule(ArrivalSpec("poisson", rate=20.0, seed=1), 4000, duration_s=10.0)
    assert bounded == [t for t in times if t <= 10.0] and 150 < len(bounded) < 250


def test_gamma_burstiness_changes_variance_not_rate() -> None:
    times = schedule(ArrivalSpec("gamma", rate=10.0, burstiness=0.25, seed=2), 4000)
    gaps = np.diff(times)
    assert gaps.mean() == pytest.approx(0.1, rel=0.1)
    assert gaps.std() / gaps.mean() == pytest.approx(2.0, rel=0.1)  # CV = 1/sqrt(shape)
    assert schedule(ArrivalSpec("gamma", rate=10.0, burstiness=0.25, seed=2), 4000) == times


def test_trace_speedup_and_concurrency() -> None:
    spec = ArrivalSpec("trace", speedup=4.0)
    assert schedule(spec, 3, trace_s=[10.0, 12.0, 30.0, 40.0]) == [0.0, 0.5, 5.0]
    assert schedule(spec, 5, duration_s=1.0, trace_s=[10.0, 12.0, 30.0]) == [0.0, 0.5]
    with pytest.raises(ValueError, match="timestamps"):
        schedule(spec, 2, trace_s=[None, None])
    with pytest.raises(ValueError, match="ascending"):
        schedule(spec, 2, trace_s=[2.0, 1.0])
    assert schedule(ArrivalSpec("concurrency", concurrency=4), 10) is None


def test_bad_specs_are_named() -> None:
    with pytest.raises(ValueError, match="rate"):
        ArrivalSpec("poisson", rate=0)
    with pytest.raises(ValueError, match="concurrency"):
        ArrivalSpec("concurrency", concurrency=0)
    with pytest.raises(ValueError, match="kind"):
        ArrivalSpec("uniform")  # type: ignore[arg-type]
