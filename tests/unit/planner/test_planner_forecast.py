import pytest

from services.planner.forecast import Holt, LoadForecast
from services.planner.signals import IntervalStats


def _stats(rate: float, inp: float = 100.0, out: float = 50.0, d: float = 10.0) -> IntervalStats:
    n = round(rate * d)
    return IntervalStats(duration_s=d, arrivals=n, mean_input_tokens=inp if n else 0.0,
                         mean_output_tokens=out if n else 0.0)


def test_constant_series_forecasts_itself() -> None:
    h = Holt()
    for _ in range(10):
        h.update(5.0)
    assert h.forecast(1) == pytest.approx(5.0)
    assert h.forecast(3) == pytest.approx(5.0)


def test_linear_ramp_is_extrapolated() -> None:
    h = Holt(alpha=0.8, beta=0.5, phi=1.0)
    for i in range(30):
        h.update(2.0 * i)
    # after a long ramp the trend is the slope: next value 60, three ahead 64
    assert h.forecast(1) == pytest.approx(60.0, abs=0.5)
    assert h.forecast(3) == pytest.approx(64.0, abs=0.5)


def test_damped_trend_stops_short_after_a_step() -> None:
    damped, plain = Holt(), Holt(phi=1.0)
    for x in (4.0,) * 10 + (1.0,) * 3:  # a phase change: 4/s down to 1/s
        damped.update(x)
        plain.update(x)
    assert plain.forecast(3) < damped.forecast(3)
    assert damped.forecast(3) > 0.3  # the undamped trend runs the rate to ~0
    assert damped.forecast(30) == pytest.approx(damped.forecast(31), abs=0.05)


def test_forecast_is_never_negative() -> None:
    h = Holt()
    for x in (10.0, 5.0, 0.0, 0.0):
        h.update(x)
    assert h.forecast(5) == 0.0


def test_empty_interval_keeps_lengths_drops_rate() -> None:
    f = LoadForecast()
    for _ in range(5):
        f.update(_stats(2.0, inp=1000.0, out=20.0))
    f.update(_stats(0.0))
    nxt = f.ahead(1)
    assert nxt.rate < 2.0
    assert nxt.input_tokens == pytest.approx(1000.0)
    assert nxt.output_tokens == pytest.approx(20.0)


def test_peak_takes_the_largest_over_the_horizon() -> None:
    f = LoadForecast(alpha=1.0, beta=1.0, phi=1.0)
    f.update(_stats(1.0))
    f.update(_stats(2.0))
    assert f.ahead(1).rate == pytest.approx(3.0)
    assert f.peak(3).rate == pytest.approx(5.0)
    f.update(_stats(1.0))  # falling: the peak is the level now
    assert f.peak(3).rate == pytest.approx(1.0)


def test_no_data_forecasts_nothing() -> None:
    f = LoadForecast()
    f.update(IntervalStats(duration_s=0.0))
    assert f.seen == 0 and f.ahead(1).rate == 0.0


def test_idle_intervals_before_the_first_arrival_are_no_evidence() -> None:
    f = LoadForecast()
    for _ in range(3):
        f.update(_stats(0.0))
    assert f.seen == 0  # the policies hold (no_data) instead of draining to the minimum
    f.update(_stats(2.0))
    assert f.seen == 1 and f.ahead(1).rate == pytest.approx(2.0)
    f.update(_stats(0.0))  # once traffic was seen, an idle interval counts (scale-down at idle)
    assert f.seen == 2 and f.ahead(1).rate < 2.0


def test_bad_smoothing_is_refused() -> None:
    with pytest.raises(ValueError, match="alpha"):
        Holt(alpha=0.0)
