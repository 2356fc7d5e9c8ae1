"""The processor's Prometheus metrics, in a registry of its own (tests host many parts)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


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
        self.inflight = Gauge(
            "tandem_processor_requests_inflight", "Requests being streamed now", registry=r)
