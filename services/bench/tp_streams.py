"""What `tandem bench tp` makes of one run: from when each step's outputs came back and how
many requests arrived before it, the figures a user feels (torch-free, no clock: the loop
in tp.py records, this computes, so the arithmetic is tested on numbers chosen by hand).

A running stream's inter-token latency (ITL) is the time between two of its consecutive
output chunks. The gap is an *arrival* gap when at least one request was added in a loop
turn inside it (the turns after the earlier chunk's step, up to and including the later
chunk's step): that arrival's ``add_request`` and its prefill, sharing the step, are what
the stream waited for. Every other gap is *quiet*. TTFT runs from a request's scheduled
arrival (not from when the loop got to it) to the step that returned its first token.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate, pairwise

from services.bench.metrics import Dist


@dataclass(frozen=True, slots=True)
class RunRecord:
    """One run of the arrival loop; times in seconds from its start (the first arrival)."""

    step_end_s: list[float]  # when each step's outputs came back, ascending
    step_arrivals: list[int]  # requests added in the loop turn before each step
    arrival_s: dict[str, float]  # each request's scheduled arrival
    chunks: dict[str, list[tuple[int, int]]]  # each request's output chunks: (step index, tokens)
    add_s: float  # the loop's time inside add_request, every arrival together

    def __post_init__(self) -> None:
        if len(self.step_end_s) != len(self.step_arrivals):
            raise ValueError(f"{len(self.step_end_s)} step times for {len(self.step_arrivals)} step arrival counts")


@dataclass(frozen=True, slots=True)
class StreamFigures:
    """Latencies in ms (Dist), throughput over the run's duration (first arrival to last step)."""

    itl_quiet: Dist  # running streams' gaps over turns where nothing arrived
    itl_arrival: Dist  # ... over turns where at least one request arrived
    ttft: Dist
    output_tok_s: float
    add_ms_per_arrival: float  # how long one arrival held the loop (the caller) in add_request
    arrivals: int
    arrival_steps: int  # steps whose loop turn added at least one request
    steps: int
    output_tokens: int
    duration_s: float


def figures(rec: RunRecord) -> StreamFigures:
    # NOTE: before[k] = requests added in the turns of steps 0 .. k-1, so a gap between the
    # chunks of steps a < b spans an arrival iff before[b + 1] > before[a + 1].
    before = list(accumulate(rec.step_arrivals, initial=0))
    quiet: list[float] = []
    hit: list[float] = []
    ttft: list[float] = []
    tokens = 0
    for rid, chunks in rec.chunks.items():
        if not chunks:
            continue
        ttft.append((rec.step_end_s[chunks[0][0]] - rec.arrival_s[rid]) * 1e3)
        tokens += sum(n for _, n in chunks)
        for (a, _), (b, _) in pairwise(chunks):
            gap_ms = (rec.step_end_s[b] - rec.step_end_s[a]) * 1e3
            (hit if before[b + 1] > before[a + 1] else quiet).append(gap_ms)
    duration = rec.step_end_s[-1] if rec.step_end_s else 0.0
    arrivals = before[-1]
    return StreamFigures(
        itl_quiet=Dist.of(quiet),
        itl_arrival=Dist.of(hit),
        ttft=Dist.of(ttft),
        output_tok_s=tokens / duration if duration > 0 else 0.0,
        add_ms_per_arrival=rec.add_s / arrivals * 1e3 if arrivals else 0.0,
        arrivals=arrivals,
        arrival_steps=sum(1 for n in rec.step_arrivals if n),
        steps=len(rec.step_end_s),
        output_tokens=tokens,
        duration_s=duration,
    )
