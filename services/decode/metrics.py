"""Worker Prometheus metrics on a registry per part (several workers share a test process).

Engine state (blocks, requests, token totals) is read from ``EngineStats`` at scrape time by
a collector, so nothing on the step thread updates metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from services.common.config import DisaggConfig
from services.engine.engine import EngineStats


class EngineStatsCollector(Collector):
    """``tandem_worker_*`` engine metrics, from ``stats()`` (docs/architecture.md, "Metrics")."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self._stats()
        for name, doc, v in (
            ("kv_blocks_used", "KV blocks referenced by a live request", s.kv_blocks_used),
            ("kv_blocks_total", "KV blocks in the pool", s.kv_blocks_total),
            ("kv_blocks_cached", "Unreferenced KV blocks kept for prefix hits", s.kv_blocks_cached),
            ("requests_running", "Requests being prefilled or decoded", s.num_running),
            ("requests_waiting", "Requests waiting (parked remote prefills included)", s.num_waiting),
            ("prefill_tokens_pending", "Tokens this engine still has to prefill", s.num_prefill_tokens_pending),
        ):
            yield GaugeMetricFamily(f"tandem_worker_{name}", doc, value=v)
        yield CounterMetricFamily("tandem_worker_prompt_tokens", "Prompt tokens admitted",
                                  value=s.prompt_tokens_total)
        yield CounterMetricFamily("tandem_worker_prefix_cache_hit_tokens",
                                  "Prompt tokens served from the prefix cache",
                                  value=s.prefix_cache_hit_tokens_total)


class DecodeMetrics:
    def __init__(self, stats: Callable[[], EngineStats], disagg: DisaggConfig,
                 registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        r.register(EngineStatsCollector(stats))
        self.prefill = Counter("tandem_worker_prefill_total",
                               "Prefills by where they ran", ["where"], registry=r)
        for where in ("local", "remote"):
            self.prefill.labels(where)
        self.fallbacks = Counter(
            "tandem_worker_remote_prefill_fallbacks_total",
            "Remote prefills that ended as local prefills, by reason", ["reason"], registry=r)
        self.decisions = Counter("tandem_worker_prefill_decisions_total",
                                 "Prefill decisions by reason", ["reason"], registry=r)
        self.kv_bytes_received = Counter("tandem_worker_kv_transfer_bytes_received_total",
                                         "KV bytes accepted from prefill workers", registry=r)
        Gauge("tandem_worker_disagg_max_local_prefill_length",
              "Prefills longer than this (uncached tokens) may go remote",
              registry=r).set(disagg.max_local_prefill_length)
        Gauge("tandem_worker_disagg_max_prefill_queue_size",
              "Remote prefill only while the queue holds fewer requests than this",
              registry=r).set(disagg.max_prefill_queue_size)
        Gauge("tandem_worker_disagg_enabled", "1 if remote prefill is enabled",
              registry=r).set(int(disagg.enabled))


class PrefillMetrics:
    def __init__(self, stats: Callable[[], EngineStats], registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        r.register(EngineStatsCollector(stats))
        self.jobs = Counter("tandem_prefill_jobs_total",
                            "Prefill jobs by outcome (delivered, rejected, expired, failed)",
                            ["outcome"], registry=r)
        self.kv_bytes_sent = Counter("tandem_prefill_kv_bytes_sent_total",
                                     "KV bytes streamed to decode workers", registry=r)
        self.kv_transfers = Counter("tandem_prefill_kv_transfers_total",
                                    "KV transfers accepted by decode workers, by transport (shm, grpc)",
                                    ["transport"], registry=r)
