"""Where a token's time goes: the engine's step time by kind and each request's queue,
prefill and decode time (vLLM's ``request_*_time_seconds``), kept as plain histograms by the
step thread and read by ``EngineStatsCollector`` at scrape time."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from services.engine.histogram import Histogram

# Seconds. A step is ~1 ms (a GPU decode) to seconds (a long CPU prefill chunk).
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.25,
                0.5, 1.0, 2.5, 5.0)
# A request phase is milliseconds (a queue with room) to minutes (a long generation).
REQUEST_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0,
                   30.0, 60.0, 120.0, 300.0)


class StepKind(enum.IntEnum):
    """What a step computed: prompt tokens only, one decode token per sequence only, or both."""

    PREFILL = 0
    DECODE = 1
    MIXED = 2

    @classmethod
    def of(cls, num_seqs: int, num_decodes: int) -> StepKind:
        if num_decodes == num_seqs:
            return cls.DECODE
        return cls.PREFILL if num_decodes == 0 else cls.MIXED


def _per_kind() -> tuple[Histogram, ...]:
    return tuple(Histogram(STEP_BUCKETS) for _ in StepKind)


@dataclass(slots=True)
class EngineTimings:
    """Written by the step thread only.

    ``step_seconds[kind]``: the wall time of one engine step that did work (schedule,
    forward, update; with overlap, from launching batch N+1 to applying batch N, by N's
    kind). Per request (choice 0 of an n > 1 request), observed when the phase ends:
    ``queue_seconds`` from arrival to its first scheduling (a remote prefill: to parking),
    ``prefill_seconds`` from then to its first token, ``decode_seconds`` from its first
    token to its last (a request that stops or hits its length; aborted ones are not
    counted)."""

    step_seconds: tuple[Histogram, ...] = field(default_factory=_per_kind)
    queue_seconds: Histogram = field(default_factory=lambda: Histogram(REQUEST_BUCKETS))
    prefill_seconds: Histogram = field(default_factory=lambda: Histogram(REQUEST_BUCKETS))
    decode_seconds: Histogram = field(default_factory=lambda: Histogram(REQUEST_BUCKETS))
