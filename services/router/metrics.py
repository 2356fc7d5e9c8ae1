"""The router's Prometheus metrics, on a registry of its own so several routers (replicas in
one test process) do not collide on the global one."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# The (kind, reason) pairs of tandem_router_events_ignored_total.
IGNORED = (("kv_events", "unregistered"), ("kv_events", "over_limit"),
           ("kv_events", "stale_session"), ("load", "unregistered"))


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.decisions = Counter(
            "tandem_router_decisions_total", "Requests routed, by chosen worker", ["worker"], registry=r
        )
        self.route_seconds = Histogram(
            "tandem_router_route_seconds", "Time to route one request (hashing included)",
            buckets=(5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 5e-2), registry=r,
        )
        self.overlap_blocks = Histogram(
            "tandem_router_overlap_blocks", "Cached prefix blocks on the chosen worker",
            buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024), registry=r,
        )
        self.ttft_error_seconds = Histogram(
            "tandem_router_ttft_prediction_error_seconds",
            "|actual - predicted| time to first token, ttft mode (from route to first token)",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10), registry=r,
        )
        self.ttft_error_ratio = Histogram(
            "tandem_router_ttft_prediction_error_ratio",
            "|actual - predicted| / actual time to first token, ttft mode",
            buckets=(0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 2, 5), registry=r,
        )
        self.indexed_blocks = Gauge(
            "tandem_router_indexed_blocks", "Blocks in the prefix index, summed over workers", registry=r
        )
        self.workers = Gauge("tandem_router_workers", "Decode workers known from discovery", registry=r)
        self.events_applied = Counter(
            "tandem_router_kv_events_applied_total", "KV events applied to the index", registry=r
        )
        self.gaps = Counter(
            "tandem_router_kv_event_gaps_total", "Event id gaps or unknown parents seen", registry=r
        )
        self.dumps = Counter(
            "tandem_router_kv_dumps_total", "Full dumps requested from workers, by outcome",
            ["outcome"], registry=r,
        )
        self.bad_messages = Counter(
            "tandem_router_bad_messages_total", "NATS messages that did not decode", ["kind"], registry=r
        )
        self.buffered_blocks = Gauge(
            "tandem_router_buffered_blocks",
            "Stored blocks in event batches held while a worker's dump is in flight", registry=r,
        )
        self.events_ignored = Counter(
            "tandem_router_events_ignored_total",
            "Decoded messages or events not applied, by kind (kv_events, load) and reason "
            "(unregistered: no such decode worker in discovery; over_limit: past "
            "router.max_blocks_per_worker; stale_session: buffered under another session "
            "than the dump's)",
            ["kind", "reason"], registry=r,
        )
        for kind, reason in IGNORED:
            self.events_ignored.labels(kind, reason)
