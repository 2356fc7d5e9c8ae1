"""The next intervals' load, forecast from the last ones: Holt's linear trend with a damped
trend (Gardner and McKenzie) on each of arrival rate, mean input and mean output length.

``level_t = a*x_t + (1-a)*(level_{t-1} + phi*trend_{t-1})``,
``trend_t = b*(level_t - level_{t-1}) + (1-b)*phi*trend_{t-1}``, forecast ``h`` intervals
ahead ``level + (phi + ... + phi^h)*trend`` (floored at 0). Why this and not a seasonal
model: the planner looks a few intervals ahead, where a ramp matters and a daily season does
not; two numbers per series, no fit. Why damped: after a step in the load (a phase change)
an undamped trend goes on falling or rising past it, and sizes for a load that never comes.
An interval with no arrivals leaves the lengths' series as they are (nothing to measure) and
the rate's falls to 0.
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
    ``beta``: how fast the trend does; ``phi``: how much of the trend is left one interval
    on (1: Holt's own, undamped)."""

    def __init__(self, alpha: float = 0.6, beta: float = 0.2, phi: float = 0.6) -> None:
        if not (0 < alpha <= 1 and 0 <= beta <= 1 and 0 <= phi <= 1):
            raise ValueError("Holt needs 0 < alpha <= 1, 0 <= beta <= 1 and 0 <= phi <= 1, "
                             f"got {alpha}, {beta}, {phi}")
        self.alpha, self.beta, self.phi = alpha, beta, phi
        self.level: float | None = None
        self.trend = 0.0

    def update(self, x: float) -> None:
        if self.level is None:
            self.level = x
            return
        prev, damped = self.level, self.phi * self.trend
        self.level = self.alpha * x + (1 - self.alpha) * (prev + damped)
        self.trend = self.beta * (self.level - prev) + (1 - self.beta) * damped

    def forecast(self, h: int) -> float:
        if self.level is None:
            return 0.0
        phi = self.phi
        reach = h if phi == 1 else phi * (1 - phi**h) / (1 - phi)
        return max(0.0, self.level + reach * self.trend)


class LoadForecast:
    """Feed it each interval's IntervalStats; ``ahead(h)`` is the load ``h`` intervals on."""

    def __init__(self, alpha: float = 0.6, beta: float = 0.2, phi: float = 0.6) -> None:
        self.rate = Holt(alpha, beta, phi)
        self.input = Holt(alpha, beta, phi)
        self.output = Holt(alpha, beta, phi)
        self.seen = 0

    def update(self, s: IntervalStats) -> None:
        # NOTE: intervals before the first arrival are no evidence of the load to come (a
        # cluster just started, a benchmark about to begin): sizing on them drained a fresh
        # cluster to its minimum just before its first burst (benchmarks/planner_live.py).
        if s.duration_s <= 0 or (not self.seen and not s.arrivals):
            return
        self.seen += 1
        self.rate.update(s.arrival_rate)
        if s.arrivals:
            self.input.update(s.mean_input_tokens)
            self.output.update(s.mean_output_tokens)

    def ahead(self, h: int) -> Load:
        return Load(self.rate.forecast(h), self.input.forecast(h), self.output.forecast(h))

    def peak(self, intervals: int) -> Load:
        """The largest of each figure now (the level) and over the next ``intervals``: what
        to size for. A split sized for the mean of a ramp up is short at its end; one sized
        for a forecast fall scales down before the load has fallen."""
        loads = [self.ahead(h) for h in range(intervals + 1)]
        return Load(max(x.rate for x in loads), max(x.input_tokens for x in loads),
                    max(x.output_tokens for x in loads))
