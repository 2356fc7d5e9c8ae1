"""The decode worker's Prometheus metrics, on a registry per worker (several share a test
process); engine state comes from ``EngineStatsCollector`` at scrape time."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.common.config import DisaggConfig
from services.decode.disagg import DecisionReason
from services.decode.kv_receiver import KvRefusal
from services.decode.move_in import MoveIn
from services.decode.move_out import MoveOutcome
from services.disagg.prefill_outcome import PrefillLocation
from services.engine.engine import EngineStats
from services.engine.stats_metrics import EngineStatsCollector


class DecodeMetrics:
    def __init__(self, stats: Callable[[], EngineStats], disagg: DisaggConfig,
                 registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        r.register(EngineStatsCollector(stats))
        self.prefill = Counter("tandem_worker_prefill_total",
                               "Prefills by where they ran", ["where"], registry=r)
        for where in PrefillLocation:
            self.prefill.labels(where.value)
        self.fallbacks = Counter(
            "tandem_worker_remote_prefill_fallbacks_total",
            "Remote prefills that ended as local prefills, by reason", ["reason"], registry=r)
        self.decisions = Counter("tandem_worker_prefill_decisions_total",
                                 "Prefill decisions by reason", ["reason"], registry=r)
        for reason in DecisionReason:
            self.decisions.labels(reason.value)
        self.kv_bytes_received = Counter("tandem_worker_kv_transfer_bytes_received_total",
                                         "KV bytes accepted from prefill workers", registry=r)
        self.kv_transfers_refused = Counter(
            "tandem_worker_kv_transfers_refused_total",
            "KvTransfer calls answered accepted=false, by reason", ["reason"], registry=r)
        for reason in KvRefusal:
            self.kv_transfers_refused.labels(reason.value)
        # Moves off a draining worker (docs/reliability.md "Moving requests on scale-down"):
        # the source counts how each request left, the target how each one continued.
        self.moved = Counter("tandem_worker_requests_moved_total",
                             "Requests this draining worker moved off, by outcome", ["outcome"],
                             registry=r)
        for o in MoveOutcome:
            self.moved.labels(o.value)
        self.move_seconds = Histogram(
            "tandem_worker_move_seconds", "From holding a request to its KV sent (or freed)",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10), registry=r)
        self.moves_in = Counter("tandem_worker_moves_received_total",
                                "Moved requests continued here, by how", ["outcome"], registry=r)
        for m in MoveIn:
            self.moves_in.labels(m.value)
        self.move_in_seconds = Histogram(
            "tandem_worker_move_in_seconds",
            "From a moved request's arrival to its KV imported (or given up: a replay)",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10), registry=r)
        # The predict policy's error, per side it chose: where the ratio sits away from 1,
        # decisions lean on a biased model (engine.step_model, the transfer's estimate).
        self.prefill_ttft_ratio = Histogram(
            "tandem_worker_prefill_ttft_ratio",
            "Measured / predicted seconds from a predict-policy decision to the first token, "
            "by the side chosen", ["where"],
            buckets=(0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2, 3, 4), registry=r)
        Gauge("tandem_worker_disagg_max_local_prefill_length",
              "Prefills longer than this (uncached tokens) may go remote",
              registry=r).set(disagg.max_local_prefill_length)
        Gauge("tandem_worker_disagg_max_prefill_queue_size",
              "Remote prefill only while the queue holds fewer requests than this",
              registry=r).set(disagg.max_prefill_queue_size)
        Gauge("tandem_worker_disagg_enabled", "1 if remote prefill is enabled",
              registry=r).set(int(disagg.enabled))

    def prefill_predicted(self, remote: bool, seconds: float, predicted: float) -> None:
        where = PrefillLocation.REMOTE if remote else PrefillLocation.LOCAL
        self.prefill_ttft_ratio.labels(where.value).observe(seconds / predicted)

    def request_moved(self, outcome: MoveOutcome, seconds: float | None) -> None:
        self.moved.labels(outcome.value).inc()
        if seconds is not None:
            self.move_seconds.observe(seconds)

    def move_received(self, outcome: MoveIn, seconds: float) -> None:
        self.moves_in.labels(outcome.value).inc()
        self.move_in_seconds.observe(seconds)

    def kv_transfer_refused(self, reason: KvRefusal) -> None:
        self.kv_transfers_refused.labels(reason.value).inc()
