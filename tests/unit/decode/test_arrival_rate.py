"""ArrivalRate: an exponentially decayed count of arrivals over its horizon."""

from __future__ import annotations

import math
import random

import pytest

from services.decode.arrival_rate import ArrivalRate


def test_a_steady_stream_reads_its_rate_and_silence_decays_it() -> None:
    r = ArrivalRate(horizon_s=20.0)
    assert r.rate(0.0) == 0.0
    t = 0.0
    for _ in range(400):  # 2 req/s for 200 s: ten horizons
        t += 0.5
        r.arrived(t)
    assert r.rate(t) == pytest.approx(2.0, rel=0.05)
    # a horizon of silence: e^-1 of it
    assert r.rate(t + 20.0) == pytest.approx(r.rate(t) / math.e)
    assert r.rate(t + 200.0) < 0.001


def test_a_poisson_stream_reads_near_its_rate_and_follows_a_change() -> None:
    rng = random.Random(3)
    r = ArrivalRate(horizon_s=20.0)
    t = 0.0
    while t < 300.0:
        t += rng.expovariate(1.0)
        r.arrived(t)
    assert 0.6 < r.rate(t) < 1.4
    while t < 400.0:  # the load triples
        t += rng.expovariate(3.0)
        r.arrived(t)
    assert 2.2 < r.rate(t) < 3.8


def test_the_first_arrivals_read_low_not_high() -> None:
    r = ArrivalRate(horizon_s=20.0)
    r.arrived(100.0)
    assert r.rate(100.0) == pytest.approx(1 / 20.0)


def test_a_horizon_must_be_positive() -> None:
    with pytest.raises(ValueError, match="horizon_s"):
        ArrivalRate(horizon_s=0.0)
