"""Serving metrics as vLLM's benchmark_serving defines them.

Per successful request: TTFT = first token - send; E2E = end - send; TPOT = (E2E - TTFT)
/ (output_tokens - 1), only for requests with more than one output token; ITL = every gap
between consecutive token chunks (pooled over requests). Throughputs divide by the run's
wall time. Goodput: successful requests meeting every SLO, per second. Failed requests
count in ``failed`` and never in latencies or goodput. Percentiles are numpy's linear ones.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from services.bench.client import RequestRecord

SLO_KEYS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")
PERCENTILES = (50, 90, 99)


def parse_slos(items: Iterable[str]) -> dict[str, float]:
    """``["ttft_ms=500", "tpot_ms=100"]`` -> dict; ValueError naming a bad item."""
    out: dict[str, float] = {}
    for item in items:
        key, sep, val = item.partition("=")
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"--slo {item!r}: expected KEY=MS with KEY one of {', '.join(SLO_KEYS)}")
        try:
            out[key] = float(val)
        except ValueError:
            raise ValueError(f"--slo {item!r}: {val!r} is not a number") from None
        if out[key] <= 0:
            raise ValueError(f"--slo {item!r}: must be > 0")
    return out


@dataclass(frozen=True)
class Dist:
    """mean / p50 / p90 / p99 in milliseconds (0 when there are no samples)."""

    mean: float
    p50: float
    p90: float
    p99: float
    count: int

    @staticmethod
    def of(values_ms: Sequence[float]) -> Dist:
        if not len(values_ms):
            return Dist(0.0, 0.0, 0.0, 0.0, 0)
        a = np.asarray(values_ms, dtype=np.float64)
        p50, p90, p99 = (float(np.percentile(a, q)) for q in PERCENTILES)
        return Dist(float(a.mean()), p50, p90, p99, len(a))


@dataclass(frozen=True)
class Summary:
    completed: int
    failed: int
    duration_s: float
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_input_tokens: int
    total_output_tokens: int
    goodput: float | None  # requests / s meeting every SLO (None: no SLO given)
    slos: dict[str, float]
    ttft: Dist
    tpot: Dist
    itl: Dist
    e2e: Dist
    prefix_hit_rate: float | None  # cached / prompt tokens from the server's usage
    errors: dict[str, int]

    def to_dict(self) -> dict:
        return asdict(self)


def _ms(x: float) -> float:
    return x * 1000.0


def request_latencies(r: RequestRecord) -> tuple[float, float | None, list[float], float]:
    """(ttft_ms, tpot_ms or None, itls_ms, e2e_ms) of a successful request."""
    assert r.first_token_time is not None and r.end_time is not None
    ttft = _ms(r.first_token_time - r.send_time)
    e2e = _ms(r.end_time - r.send_time)
    n = r.output_tokens
    tpot = (e2e - ttft) / (n - 1) if n > 1 else None
    itls = [_ms(b - a) for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False)]
    return ttft, tpot, itls, e2e


def meets_slos(slos: dict[str, float], ttft: float, tpot: float | None,
               max_itl: float | None, e2e: float) -> bool:
    """Whether one successful request meets every SLO given (all in ms): its TTFT, TPOT,
    largest inter-token gap and E2E each at most its target. A single-token answer has no
    TPOT nor gap (None), so those targets do not apply to it."""
    if "ttft_ms" in slos and ttft > slos["ttft_ms"]:
        return False
    if "tpot_ms" in slos and tpot is not None and tpot > slos["tpot_ms"]:
        return False
    if "itl_ms" in slos and max_itl is not None and max_itl > slos["itl_ms"]:
        return False
    return not ("e2e_ms" in slos and e2e > slos["e2e_ms"])


def summarize(records: Sequence[RequestRecord], duration_s: float,
              slos: dict[str, float] | None = None) -> Summary:
    slos = dict(slos or {})
    if duration_s <= 0:
        raise ValueError(f"summarize: duration_s must be > 0, got {duration_s}")
    ttfts: list[float] = []
    tpots: list[float] = []
    itls: list[float] = []
    e2es: list[float] = []
    good = 0
    errors: dict[str, int] = {}
    out_tokens = in_tokens = cached = prompt_reported = 0
    ok = [r for r in records if r.ok]
    for r in records:
        if not r.ok:
            key = r.error.split(":")[0] or "unknown"
            errors[key] = errors.get(key, 0) + 1
    for r in ok:
        ttft, tpot, gaps, e2e = request_latencies(r)
        ttfts.append(ttft)
        e2es.append(e2e)
        itls.extend(gaps)
        if tpot is not None:
            tpots.append(tpot)
        if meets_slos(slos, ttft, tpot, max(gaps) if gaps else None, e2e):
            good += 1
        out_tokens += r.output_tokens
        in_tokens += r.prompt_tokens if r.prompt_tokens is not None else r.prompt_len
        if r.cached_tokens is not None and r.prompt_tokens:
            cached += r.cached_tokens
            prompt_reported += r.prompt_tokens
    return Summary(
        completed=len(ok), failed=len(records) - len(ok), duration_s=duration_s,
        request_throughput=len(ok) / duration_s, output_throughput=out_tokens / duration_s,
        total_input_tokens=in_tokens, total_output_tokens=out_tokens,
        goodput=good / duration_s if slos else None, slos=slos,
        ttft=Dist.of(ttfts), tpot=Dist.of(tpots), itl=Dist.of(itls), e2e=Dist.of(e2es),
        prefix_hit_rate=cached / prompt_reported if prompt_reported else None, errors=errors,
    )
