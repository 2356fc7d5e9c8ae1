"""What a simulation records: one row per request, pooled inter-token gaps, and samples of
each worker's load and the cluster's hit rate over virtual time (for the plots)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestRecord:
    """One request's life on the virtual clock (seconds from the replay's start).

    ``sent_s``: when the client sent it (its arrival, or its previous turn's end);
    ``first_token_s`` / ``end_s``: 0 until they happen (``completed`` says whether it
    ended); ``cached_tokens``: prompt tokens its decode worker's prefix cache served when
    it was admitted (a remote prefill: the cache of the prefill worker that ran it, plus
    the decode worker's own hit); ``remote``: prefilled by a prefill worker;
    ``max_gap_s``: its largest inter-token gap (0 before its second token: the goodput
    rule's ``itl_ms`` needs it per request, the pooled gaps cannot tell);
    ``error``: why it failed (refused by a full worker), None when it did not."""

    index: int
    sent_s: float
    prompt_tokens: int
    output_tokens: int  # what it asked for
    worker: str = ""
    prefill_worker: str = ""
    remote: bool = False
    cached_tokens: int = 0
    first_token_s: float = 0.0
    end_s: float = 0.0
    tokens_out: int = 0
    last_token_s: float = 0.0
    max_gap_s: float = 0.0
    completed: bool = False
    error: str | None = None

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.sent_s

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.sent_s

    @property
    def tpot_s(self) -> float | None:
        """(end - first token) / (tokens - 1); None for a single-token answer."""
        if self.tokens_out < 2:
            return None
        return (self.end_s - self.first_token_s) / (self.tokens_out - 1)


@dataclass(slots=True)
class GapSamples:
    """Inter-token gaps pooled over requests, as ``(gap_s, count)`` pairs: a fast-forwarded
    run of decode steps adds each step's gap once with the batch's size as its count."""

    values: list[float] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)

    def add(self, gap_s: float, count: int = 1) -> None:
        self.values.append(gap_s)
        self.counts.append(count)


@dataclass(frozen=True, slots=True)
class WorkerSample:
    """One worker's state at a load tick (``t_s``): what its load sample reports."""

    t_s: float
    worker: str
    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    prefill_tokens_pending: int


@dataclass(frozen=True, slots=True)
class HitSample:
    """Prompt tokens admitted and served from cache, cumulative, at ``t_s``."""

    t_s: float
    prompt_tokens: int
    hit_tokens: int


@dataclass(slots=True)
class WorkerTotals:
    """One worker over the whole run. ``role``: "decode" or "prefill"; ``prompt_tokens`` /
    ``hit_tokens``: prompt tokens its engine admitted and those its prefix cache served;
    ``peak_kv_blocks_used``: the most blocks live requests held at once."""

    worker: str
    role: str
    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    peak_kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    busy_s: float = 0.0  # virtual seconds spent in steps
    steps: int = 0


@dataclass(slots=True)
class SimResult:
    """Everything a run produced; ``services.sim.report`` turns it into the JSON summary,
    the per-request JSONL and the plots. ``duration_s``: the virtual time of the last event;
    ``wall_s``: the real seconds the run took; ``slo``: the config's ``sim.slo``
    (``ttft_ms``, ``tpot_ms``, ``itl_ms``, ``e2e_ms``; absent keys are not checked)."""

    records: list[RequestRecord]
    gaps: GapSamples
    workers: list[WorkerTotals]
    worker_samples: list[WorkerSample]
    hit_samples: list[HitSample]
    oracle_hit_rate: float
    slo: dict[str, float]
    duration_s: float
    wall_s: float
    steps: int = 0  # engine steps simulated one by one
    fast_forward_steps: int = 0  # engine steps advanced in runs of pure decode
    # (predicted, actual) TTFT seconds of each routed request, router.mode ttft only
    ttft_predictions: list[tuple[float, float]] = field(default_factory=list)
