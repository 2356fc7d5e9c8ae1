"""What the planner reads of the cluster each interval: one snapshot, the same whether it
comes from a live cluster (NATS load samples, the prefill stream, the processors' metrics)
or from the simulator."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class Role(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True, slots=True)
class WorkerSignals:
    worker_id: str
    role: Role
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    requests_running: int = 0
    requests_waiting: int = 0
    # prompt tokens still to compute on this worker (WorkerLoad.active_prefill_tokens)
    pending_prefill_tokens: int = 0
    # output tokens its running requests have still to produce (live: max_tokens less what
    # they streamed, over those that set one; the simulator knows each exactly), and how
    # many running requests set no max_tokens: the lookahead prices each of those at half
    # the forecast's output length, and every one when both are 0 (nothing known)
    decode_tokens_left: int = 0
    running_unbounded: int = 0
    ready: bool = True  # False while starting (not yet in discovery) or draining


@dataclass(frozen=True, slots=True)
class IntervalStats:
    """The last interval's traffic as the clients saw it."""

    duration_s: float
    arrivals: int = 0
    mean_input_tokens: float = 0.0
    mean_output_tokens: float = 0.0
    ttft_p90_s: float | None = None  # None: no request finished its prefill in the interval
    itl_p90_s: float | None = None
    prefill_tokens_done: int = 0  # prompt tokens computed, remote and local
    prefill_busy_s: float = 0.0  # prefill-worker seconds spent computing them

    @property
    def arrival_rate(self) -> float:
        return self.arrivals / self.duration_s if self.duration_s > 0 else 0.0


@dataclass(frozen=True, slots=True)
class ClusterSignals:
    t: float  # seconds (unix time live, the virtual clock in the simulator)
    workers: tuple[WorkerSignals, ...] = ()
    prefill_queue_jobs: int = 0
    prefill_queue_tokens: int = 0
    prefill_queue_oldest_wait_s: float = 0.0
    last: IntervalStats = field(default_factory=lambda: IntervalStats(duration_s=0.0))

    def count(self, role: Role, ready_only: bool = False) -> int:
        return sum(1 for w in self.workers if w.role is role and (w.ready or not ready_only))
