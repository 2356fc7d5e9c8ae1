"""The prefill worker's Prometheus metrics, on a registry per worker."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter

from services.engine.engine import EngineStats
from services.engine.stats_metrics import EngineStatsCollector


class PrefillMetrics:
    def __init__(self, stats: Callable[[], EngineStats], registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        r.register(EngineStatsCollector(stats))
        self.jobs = Counter("tandem_prefill_jobs_total",
                            "Prefill jobs by outcome (delivered, rejected, expired, failed, "
                            "malformed, refused)", ["outcome"], registry=r)
        self.jobs_refused = Counter(
            "tandem_prefill_jobs_refused_total",
            "Prefill jobs terminated without work: no transfer token, or a decode worker or "
            "address discovery does not list", ["reason"], registry=r)
        self.kv_bytes_sent = Counter("tandem_prefill_kv_bytes_sent_total",
                                     "KV bytes streamed to decode workers", registry=r)
        self.kv_transfers = Counter("tandem_prefill_kv_transfers_total",
                                    "KV transfers accepted by decode workers, by transport (shm, grpc)",
                                    ["transport"], registry=r)
