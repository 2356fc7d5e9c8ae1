"""The next intervals' load, forecast from the last ones: Holt's linear trend (double
exponential smoothing) on each of arrival rate, mean input length and mean output length.

Holt: ``level_t = a*x_t + (1-a)*(level_{t-1} + trend_{t-1})``,
``trend_t = b*(level_t - level_{t-1}) + (1-b)*trend_{t-1}``, forecast ``h`` intervals ahead
``level + h*trend`` (floored at 0). Why this and not a seasonal model: the planner looks a
few intervals ahead, where a ramp matters and a daily season does not; two numbers per
series to keep, no fit. An interval with no arrivals leaves the lengths' series as they are
(there is nothing to measure) and the rate's falls to 0.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.planner.signals import IntervalStats


@dataclass(frozen=True, slots=True)
class Load:
    """Traffic over one future interval: requests per second and their mean lengths."""

    rate: float
    input_tokens: float
    output_tokens: float


class Holt:
    """One series' level and trend. ``alpha``: how fast the level follows a new value;
    ``beta``: how fast the trend does."""

    def __init__(self, alpha: float = 0.5, beta: float = 0.3) -> None:
        if not (0 < alpha <= 1 and 0 <= beta <= 1):
            raise ValueError(f"Holt needs 0 < alpha <= 1 and 0 <= beta <= 1, got {alpha}, {beta}")
        self.alpha, self.beta = alpha, beta
        self.level: float | None = None
        self.trend = 0.0

    def update(self, x: float) -> None:
        if self.level is None:
            self.level = x
            return
        prev = self.level
        self.level = self.alpha * x + (1 - self.alpha) * (prev + self.trend)
        self.trend = self.beta * (self.level - prev) + (1 - self.beta) * self.trend

    def forecast(self, h: int) -> float:
        if self.level is None:
            return 0.0
        return max(0.0, self.level + h * self.trend)


class LoadForecast:
    """Feed it each interval's IntervalStats; ``ahead(h)`` is the load ``h`` intervals on."""

    def __init__(self, alpha: float = 0.5, beta: float = 0.3) -> None:
        self.rate = Holt(alpha, beta)
        self.input = Holt(alpha, beta)
        self.output = Holt(alpha, beta)
        self.seen = 0

    def update(self, s: IntervalStats) -> None:
        if s.duration_s <= 0:
            return
        self.seen += 1
        self.rate.update(s.arrival_rate)
        if s.arrivals:
            self.input.update(s.mean_input_tokens)
            self.output.update(s.mean_output_tokens)

    def ahead(self, h: int) -> Load:
        return Load(self.rate.forecast(h), self.input.forecast(h), self.output.forecast(h))

    def peak(self, intervals: int) -> Load:
        """The largest of each figure over the next ``intervals``: what to size for (a split
        sized for the mean of a ramp is short at its end)."""
        loads = [self.ahead(h) for h in range(1, intervals + 1)]
        return Load(max(x.rate for x in loads), max(x.input_tokens for x in loads),
                    max(x.output_tokens for x in loads))
