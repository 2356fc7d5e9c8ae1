"""What a simulation reports: the JSON summary (its keys are fixed by issue 23: scripts read
them), one JSON line per request, and the text table a sweep prints.

Latencies follow services/bench/metrics.py: TTFT, E2E and TPOT over completed requests,
ITL over every gap pooled, numpy's linear percentiles, goodput by its SLO rule
(``meets_slos``). Rates divide by the run's virtual ``duration_s``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from services.bench.metrics import PERCENTILES, Dist, meets_slos
from services.sim.records import GapSamples, RequestRecord, SimResult, WorkerTotals

# Milliseconds to the microsecond, fractions and rates to 1e-4 relative-ish.
_MS, _FRAC, _RATE, _SEC = 3, 4, 4, 3


def weighted_percentiles(values: np.ndarray, counts: np.ndarray,
                         qs: Sequence[float] = PERCENTILES) -> list[float]:
    """``np.percentile(np.repeat(values, counts), qs)`` (linear method), bit for bit,
    without the expansion: numpy's virtual index ``(n - 1) * q / 100``, its two
    neighbouring order statistics found in the cumulative counts, and numpy's ``_lerp``
    (which interpolates from the upper side when the fraction is at least 0.5)."""
    keep = counts > 0
    v, c = values[keep], counts[keep]
    if not len(v):
        raise ValueError("weighted_percentiles: no samples")
    order = np.argsort(v, kind="stable")
    v = v[order].astype(np.float64)
    cum = np.cumsum(c[order].astype(np.int64))  # cum[i]: order statistics 0..cum[i]-1 are <= v[i]
    n = int(cum[-1])
    out: list[float] = []
    for q in qs:
        virtual = (n - 1) * np.true_divide(q, 100)
        if virtual >= n - 1:
            out.append(float(v[-1]))
            continue
        lo = np.floor(virtual)
        gamma = virtual - lo
        a = v[int(np.searchsorted(cum, int(lo), side="right"))]
        b = v[int(np.searchsorted(cum, int(lo) + 1, side="right"))]
        diff = b - a
        out.append(float(b - diff * (1 - gamma) if gamma >= 0.5 else a + diff * gamma))
    return out


def _dist(d: Dist) -> dict[str, float]:
    return {"mean": round(d.mean, _MS), "p50": round(d.p50, _MS), "p90": round(d.p90, _MS),
            "p99": round(d.p99, _MS)}


def gap_dist_ms(gaps: GapSamples) -> Dist:
    """The pooled ITL's distribution in ms, as if each gap were repeated ``count`` times."""
    counts = np.asarray(gaps.counts, dtype=np.int64)
    total = int(counts.sum()) if len(counts) else 0
    if total == 0:
        return Dist(0.0, 0.0, 0.0, 0.0, 0)
    ms = np.asarray(gaps.values, dtype=np.float64) * 1000.0
    p50, p90, p99 = weighted_percentiles(ms, counts)
    return Dist(float(np.dot(ms, counts) / total), p50, p90, p99, total)


def request_latencies_ms(r: RequestRecord) -> tuple[float, float | None, float]:
    """(ttft, tpot or None, e2e) of one request, in ms."""
    tpot = r.tpot_s
    return r.ttft_s * 1000.0, None if tpot is None else tpot * 1000.0, r.e2e_s * 1000.0


def meets(slo: dict[str, float], r: RequestRecord) -> bool:
    ttft, tpot, e2e = request_latencies_ms(r)
    max_itl = r.max_gap_s * 1000.0 if r.tokens_out > 1 else None
    return meets_slos(slo, ttft, tpot, max_itl, e2e)


def _per_worker(w: WorkerTotals, duration_s: float) -> dict[str, Any]:
    return {
        "role": w.role,
        "requests": w.requests,
        "hit_rate": round(w.hit_tokens / w.prompt_tokens, _FRAC) if w.prompt_tokens else 0.0,
        "peak_kv_use": (round(w.peak_kv_blocks_used / w.kv_blocks_total, _FRAC)
                        if w.kv_blocks_total else 0.0),
        "busy_fraction": round(w.busy_s / duration_s, _FRAC) if duration_s > 0 else 0.0,
    }


def summary(result: SimResult) -> dict[str, Any]:
    """The run's JSON summary. Hit rate and remote-prefill fraction are over completed
    requests (``cached_tokens / prompt_tokens``; those prefilled remotely / completed);
    ``failed`` counts every request that did not complete."""
    done = [r for r in result.records if r.completed]
    ttft, tpot, e2e = [], [], []
    good = 0
    for r in done:
        a, b, c = request_latencies_ms(r)
        ttft.append(a)
        e2e.append(c)
        if b is not None:
            tpot.append(b)
        if meets(result.slo, r):
            good += 1
    prompt = sum(r.prompt_tokens for r in done)
    cached = sum(r.cached_tokens for r in done)
    dur = result.duration_s

    def per_s(x: float) -> float:
        return round(x / dur, _RATE) if dur > 0 else 0.0

    return {
        "requests": len(result.records),
        "completed": len(done),
        "failed": len(result.records) - len(done),
        "ttft_ms": _dist(Dist.of(ttft)),
        "itl_ms": _dist(gap_dist_ms(result.gaps)),
        "e2e_ms": _dist(Dist.of(e2e)),
        "tpot_ms": _dist(Dist.of(tpot)),
        "prefix_hit_rate": round(cached / prompt, _FRAC) if prompt else 0.0,
        "oracle_hit_rate": round(result.oracle_hit_rate, _FRAC),
        "goodput_rps": per_s(good),
        "throughput_rps": per_s(len(done)),
        "output_tok_s": per_s(sum(r.tokens_out for r in done)),
        "remote_prefill_fraction": (round(sum(r.remote for r in done) / len(done), _FRAC)
                                    if done else 0.0),
        "per_worker": {w.worker: _per_worker(w, dur) for w in result.workers},
        "duration_s": round(dur, _SEC),
        "wall_s": round(result.wall_s, _SEC),
        "steps": result.steps,
        "fast_forward_steps": result.fast_forward_steps,
        **({"ttft_prediction_error": prediction_error(result.ttft_predictions)}
           if result.ttft_predictions else {}),
    }


def prediction_error(pairs: Sequence[tuple[float, float]]) -> dict[str, float]:
    """Median and p90 of |actual - predicted| (ms) and of it over actual, over (predicted,
    actual) pairs in seconds; ``bias_ms``: the mean of actual - predicted."""
    pred = np.array([p for p, _ in pairs])
    act = np.array([a for _, a in pairs])
    err = np.abs(act - pred)
    rel = err[act > 0] / act[act > 0]
    return {
        "count": len(pairs),
        "abs_ms_p50": round(float(np.percentile(err, 50)) * 1e3, 3),
        "abs_ms_p90": round(float(np.percentile(err, 90)) * 1e3, 3),
        "rel_p50": round(float(np.percentile(rel, 50)), 4) if rel.size else 0.0,
        "rel_p90": round(float(np.percentile(rel, 90)), 4) if rel.size else 0.0,
        "bias_ms": round(float(np.mean(act - pred)) * 1e3, 3),
    }


def write_requests(result: SimResult, path: str | Path) -> Path:
    """One JSON line per request: every ``RequestRecord`` field plus its ``ttft_ms``,
    ``tpot_ms`` (null for a single-token answer) and ``e2e_ms`` (null where it did not
    complete)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as f:
        for r in result.records:
            row = asdict(r)
            ttft, tpot, e2e = request_latencies_ms(r)
            row["ttft_ms"] = round(ttft, _MS) if r.completed else None
            row["tpot_ms"] = round(tpot, _MS) if r.completed and tpot is not None else None
            row["e2e_ms"] = round(e2e, _MS) if r.completed else None
            f.write(json.dumps(row, separators=(",", ":")) + "\n")
    return out


def cell(value: object) -> str:
    """A table cell: floats to three decimals, the rest as ``str``."""
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def format_row(cells: Sequence[str], widths: Sequence[int]) -> str:
    return "  ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True))


def format_table(rows: Sequence[dict[str, object]]) -> str:
    """Rows of the same keys as an aligned text table under a header of the keys; ``""``
    for no rows."""
    if not rows:
        return ""
    columns = list(rows[0])
    cells = [[cell(r[c]) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    return "\n".join(format_row(line, widths) for line in [columns, *cells])
