"""SimResult objects built by hand for the report, plot and sweep tests."""

from __future__ import annotations

from services.sim.records import (
    GapSamples,
    HitSample,
    RequestRecord,
    SimResult,
    WorkerSample,
    WorkerTotals,
)


def record(index: int, sent: float = 0.0, ttft: float = 0.1, tokens: int = 5, tpot: float = 0.02,
           prompt: int = 100, cached: int = 0, remote: bool = False, max_gap: float | None = None,
           completed: bool = True, worker: str = "decode-0") -> RequestRecord:
    """A request sent at ``sent`` with these latencies (s); ``max_gap`` defaults to ``tpot``."""
    first = sent + ttft
    end = first + tpot * (tokens - 1)
    return RequestRecord(
        index=index, sent_s=sent, prompt_tokens=prompt, output_tokens=tokens, worker=worker,
        remote=remote, cached_tokens=cached, first_token_s=first if completed else 0.0,
        end_s=end, tokens_out=tokens if completed else 0, last_token_s=end,
        max_gap_s=(tpot if max_gap is None else max_gap) if tokens > 1 else 0.0,
        completed=completed, error=None if completed else "refused")


def worker_samples(workers: int, ticks: int, interval: float = 0.25) -> list[WorkerSample]:
    """Every worker sampled at every tick, loads varying by worker and time."""
    return [WorkerSample(t * interval, f"decode-{w}", running=(t + w) % 7, waiting=(t * w) % 3,
                         kv_blocks_used=(t * 13 + w * 5) % 64, kv_blocks_total=64,
                         prefill_tokens_pending=((t + 2 * w) % 5) * 100)
            for t in range(ticks) for w in range(workers)]


def hit_samples(ticks: int, interval: float = 0.25) -> list[HitSample]:
    return [HitSample(t * interval, prompt_tokens=1000 * t, hit_tokens=300 * t + t * t // 8)
            for t in range(ticks)]


def result(records: list[RequestRecord], gaps: GapSamples | None = None, workers: int = 2,
           ticks: int = 40, slo: dict[str, float] | None = None,
           duration: float = 10.0) -> SimResult:
    totals = [WorkerTotals(f"decode-{w}", "decode", requests=3 + w, prompt_tokens=1000,
                           hit_tokens=250 * w, peak_kv_blocks_used=32 + w, kv_blocks_total=64,
                           busy_s=2.5 * (w + 1), steps=10) for w in range(workers)]
    totals.append(WorkerTotals("prefill-0", "prefill", requests=1, prompt_tokens=0,
                               kv_blocks_total=64, busy_s=1.0, steps=2))
    return SimResult(
        records=records, gaps=gaps if gaps is not None else GapSamples([0.02, 0.03], [3, 1]),
        workers=totals, worker_samples=worker_samples(workers, ticks),
        hit_samples=hit_samples(ticks), oracle_hit_rate=0.61234567,
        slo={"ttft_ms": 2000.0} if slo is None else slo, duration_s=duration, wall_s=1.23456,
        steps=100, fast_forward_steps=900)
