"""The frontend's Prometheus metrics, in a per-app registry (docs/architecture.md, "Metrics")."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

# Seconds; fine at the low end where CPU decode steps live, up to a long prefill.
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64,
                    1.28, 2.56, 5.12, 10.24, 20.48, 40.96)
_DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 600)


class FrontendMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "tandem_frontend_requests_total",
            "Completed API requests by HTTP status (499: the client went away mid-stream)",
            ["status"], registry=r)
        self.ttft = Histogram(
            "tandem_frontend_time_to_first_token_seconds",
            "From request arrival to the first generated text", buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(
            "tandem_frontend_inter_token_latency_seconds",
            "Between consecutive streamed deltas of one request", buckets=_LATENCY_BUCKETS,
            registry=r)
        self.duration = Histogram(
            "tandem_frontend_request_duration_seconds",
            "From request arrival to its last byte", buckets=_DURATION_BUCKETS, registry=r)
