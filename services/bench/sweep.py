"""Rate sweeps: SLO attainment per request rate, and goodput as DistServe defines it.

SLO attainment at a rate: the share of the requests sent at that rate that succeeded and
met every target of ``--slo`` (a sweep needs both ``ttft_ms`` and ``tpot_ms``; a failed
request counts as a miss). A layout's goodput is the highest swept rate at which the
attainment is at least the target (``--attainment``, 0.9 by default; DistServe, OSDI '24,
section 2), 0 when no rate reaches it. Note that this is a rate the layout *sustains*, in
requests/s sent, not `bench serve`'s per-run goodput (requests meeting the SLOs per second
of wall time).

Two layouts compare by the ratio of their goodputs (run / baseline), and at the highest
rate both sustain by their TTFT p99 and ITL p99 (baseline / run: > 1 means the run is
better). Pure functions over result rows as `bench serve` writes them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass

from services.bench.metrics import meets_slos

SWEEP_SLOS = ("ttft_ms", "tpot_ms")
DEFAULT_ATTAINMENT = 0.9


def parse_rates(text: str) -> tuple[float, ...]:
    """``"0.25,0.5,1"`` -> ascending distinct rates; ValueError naming the bad item."""
    rates: list[float] = []
    for item in (s.strip() for s in text.split(",")):
        try:
            r = float(item)
        except ValueError:
            raise ValueError(f"--rates {text!r}: {item!r} is not a number") from None
        if not r > 0:
            raise ValueError(f"--rates {text!r}: every rate must be > 0, got {item!r}")
        rates.append(r)
    if len(set(rates)) != len(rates):
        raise ValueError(f"--rates {text!r}: a rate is given twice")
    return tuple(sorted(rates))


def check_sweep(slos: Mapping[str, float], target: float, arrival: str) -> None:
    """What a sweep needs, checked before any cluster starts (ValueError naming the option)."""
    missing = [k for k in SWEEP_SLOS if k not in slos]
    if missing:
        raise ValueError(f"--rates needs --slo {' and '.join(f'{k}=MS' for k in missing)}: "
                         "attainment is against both the TTFT and the TPOT target")
    if not 0 < target <= 1:
        raise ValueError(f"--attainment must be in (0, 1], got {target}")
    if arrival not in ("poisson", "gamma"):
        raise ValueError(f"--rates needs --arrival poisson or gamma, not {arrival}")


def slo_attainment(rows: Iterable[Mapping], slos: Mapping[str, float]) -> tuple[int, int]:
    """(requests meeting every SLO, requests) over result rows (``ok``, ``ttft_ms``,
    ``tpot_ms``, ``e2e_ms``, optionally ``max_itl_ms``); a failed row is a miss."""
    met = n = 0
    for r in rows:
        n += 1
        if r["ok"] and meets_slos(dict(slos), r["ttft_ms"], r["tpot_ms"], r.get("max_itl_ms"),
                                  r["e2e_ms"]):
            met += 1
    return met, n


@dataclass(frozen=True)
class RatePoint:
    """One layout at one swept rate (latencies in ms, throughputs per second of the run)."""

    rate: float
    requests: int
    failed: int
    met_slos: int
    attainment: float  # met_slos / requests (0 for no requests)
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p99_ms: float
    request_throughput: float
    output_throughput: float

    @staticmethod
    def of(rate: float, result: Mapping, slos: Mapping[str, float]) -> RatePoint:
        """From a full `bench serve` result (it needs the per-request rows)."""
        met, n = slo_attainment(result["requests"], slos)
        s = result["summary"]
        return RatePoint(rate, n, s["failed"], met, met / n if n else 0.0,
                         s["ttft"]["p50"], s["ttft"]["p99"], s["itl"]["p99"],
                         s["request_throughput"], s["output_throughput"])


@dataclass(frozen=True)
class LayoutSweep:
    """A layout's points, ascending by rate, and its goodput (req/s; 0: none sustained)."""

    name: str
    points: tuple[RatePoint, ...]
    goodput_rps: float

    @staticmethod
    def of(name: str, points: Sequence[RatePoint], target: float) -> LayoutSweep:
        pts = tuple(sorted(points, key=lambda p: p.rate))
        return LayoutSweep(name, pts, goodput_rate(pts, target))

    def at(self, rate: float) -> RatePoint:
        return next(p for p in self.points if p.rate == rate)

    def to_dict(self) -> dict:
        return asdict(self)


def goodput_rate(points: Iterable[RatePoint], target: float) -> float:
    """The highest rate whose attainment is >= ``target``; 0.0 when none is. A lower rate
    that misses the target (noise on a busy machine) does not cap it: DistServe's goodput
    is the highest rate that meets the goal."""
    return max((p.rate for p in points if p.attainment >= target), default=0.0)


def sustained_by_both(a: LayoutSweep, b: LayoutSweep, target: float) -> float | None:
    """The highest rate swept for both at which both reach ``target``; None when none."""
    ok_a = {p.rate for p in a.points if p.attainment >= target}
    ok_b = {p.rate for p in b.points if p.attainment >= target}
    return max(ok_a & ok_b, default=None)


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


@dataclass(frozen=True)
class SweepComparison:
    """``run`` against ``baseline``: goodput run / baseline; at ``sustained_rate`` (the
    highest rate both sustain) TTFT p99 and ITL p99 baseline / run (> 1: run better).
    None where a ratio has no denominator or no rate is sustained by both."""

    baseline: str
    run: str
    goodput_ratio: float | None
    sustained_rate: float | None
    ttft_p99_ratio: float | None
    itl_p99_ratio: float | None

    @staticmethod
    def of(baseline: LayoutSweep, run: LayoutSweep, target: float) -> SweepComparison:
        rate = sustained_by_both(baseline, run, target)
        ttft = itl = None
        if rate is not None:
            b, r = baseline.at(rate), run.at(rate)
            ttft, itl = _ratio(b.ttft_p99_ms, r.ttft_p99_ms), _ratio(b.itl_p99_ms, r.itl_p99_ms)
        return SweepComparison(baseline.name, run.name,
                               _ratio(run.goodput_rps, baseline.goodput_rps), rate, ttft, itl)

    def to_dict(self) -> dict:
        return asdict(self)


def comparisons(sweeps: Sequence[LayoutSweep], target: float) -> list[SweepComparison]:
    """Every layout after the first against the first (the baseline)."""
    return [SweepComparison.of(sweeps[0], s, target) for s in sweeps[1:]]


def _f(v: float | None, fmt: str) -> str:
    return "n/a" if v is None else fmt.format(v)


def layout_table(sweep: LayoutSweep, target: float) -> str:
    """One row per rate, then the layout's goodput."""
    lines = [f"{sweep.name}: SLO attainment by rate",
             f"{'rate req/s':>10s} {'done/failed':>11s} {'attain':>7s} {'TTFT p50':>9s} "
             f"{'TTFT p99':>9s} {'ITL p99':>8s} {'req/s':>6s} {'tok/s':>7s}"]
    for p in sweep.points:
        mark = " " if p.attainment >= target else "*"
        lines.append(f"{p.rate:>10.3g} {f'{p.requests - p.failed}/{p.failed}':>11s} "
                     f"{p.attainment:>6.1%}{mark} {p.ttft_p50_ms:>9.0f} {p.ttft_p99_ms:>9.0f} "
                     f"{p.itl_p99_ms:>8.0f} {p.request_throughput:>6.2f} "
                     f"{p.output_throughput:>7.1f}")
    lines.append(f"goodput {sweep.goodput_rps:.3g} req/s (highest rate with attainment >= "
                 f"{target:.0%}; * below it; latencies in ms)")
    return "\n".join(lines)


def comparison_table(sweeps: Sequence[LayoutSweep], target: float) -> str:
    """Side by side: each layout's goodput, and each layout against the first."""
    lines = [f"{'layout':16s} {'goodput req/s':>13s}"]
    lines += [f"{s.name:16s} {s.goodput_rps:>13.3g}" for s in sweeps]
    for c in comparisons(sweeps, target):
        lines.append(f"{c.run} vs {c.baseline}: goodput {_f(c.goodput_ratio, '{:.2f}x')}; "
                     + ("no rate sustained by both" if c.sustained_rate is None else
                        f"at {c.sustained_rate:.3g} req/s (highest both sustain) TTFT p99 "
                        f"{_f(c.ttft_p99_ratio, '{:.2f}x')}, ITL p99 "
                        f"{_f(c.itl_p99_ratio, '{:.2f}x')} ({c.baseline} / {c.run}: > 1 "
                        f"means {c.run} is better)"))
    return "\n".join(lines)


def sweep_json(sweeps: Sequence[LayoutSweep], rates: Sequence[float], target: float,
               slos: Mapping[str, float]) -> dict:
    """The ``sweep`` section of a result file."""
    return {"rates": list(rates), "attainment_target": target, "slos": dict(slos),
            "layouts": {s.name: s.to_dict() for s in sweeps},
            "comparisons": [c.to_dict() for c in comparisons(sweeps, target)]}
