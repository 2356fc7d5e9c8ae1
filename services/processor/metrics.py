"""The processor's Prometheus metrics, in a registry of its own (tests host many parts)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class ProcessorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "tandem_processor_requests_total",
            "Requests by outcome: stop, length, cancelled, invalid, unavailable, error",
            ["outcome"], registry=r)
        self.prompt_tokens = Counter(
            "tandem_processor_prompt_tokens_total", "Prompt tokens of routed requests", registry=r)
        self.completion_tokens = Counter(
            "tandem_processor_completion_tokens_total", "Tokens received from decode workers",
            registry=r)
        self.migrations = Counter(
            "tandem_processor_migrations_total",
            "Streams moved to another decode worker after theirs failed", registry=r)
        # Streams a draining decode worker ended (docs/reliability.md "Moving requests on
        # scale-down"): "kv" with its KV held for the next worker, "replay" handed back.
        self.moves = Counter(
            "tandem_processor_moves_total",
            "Streams continued elsewhere because their decode worker drained, by kind",
            ["kind"], registry=r)
        for kind in ("kv", "replay"):
            self.moves.labels(kind)
        self.move_gap = Histogram(
            "tandem_processor_move_gap_seconds",
            "Between the last token before a move and the first one after it",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10), registry=r)
        self.inflight = Gauge(
            "tandem_processor_requests_inflight", "Requests being streamed now", registry=r)
