"""Engine state as Prometheus metrics, read from ``EngineStats`` at scrape time by a
collector, so nothing on the step thread updates metrics. Decode and prefill workers both
register it."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from services.engine.engine import EngineStats
from services.engine.grammar.stats import GrammarStats
from services.engine.histogram import Histogram
from services.engine.timings import EngineTimings, StepKind


class EngineStatsCollector(Collector):
    """``tandem_worker_*`` engine metrics, from ``stats()`` (docs/architecture.md, "Metrics")."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily]:
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
        yield from _timing_metrics(s.timings)
        info = GaugeMetricFamily("tandem_worker_engine_info", "What computes the engine's steps (value 1)",
                                 labels=["device", "dtype", "quantization", "cpu_isa"])
        r = s.runner
        info.add_metric([r.device, r.dtype, r.quantization, r.cpu_isa], 1)
        yield info
        if s.step_speed is not None:
            speed = GaugeMetricFamily(
                "tandem_worker_engine_step_speed_ratio",
                "Measured / modelled seconds of the engine's steps (engine.step_model), by the "
                "model's fit: decode (decode-only steps), prefill (steps with prefill, which the "
                "ITL target's budget reads), rows (steps with a few prefill tokens that ran as "
                "per-token rows, the CPU's one-call step)", labels=["kind"])
            spread = GaugeMetricFamily(
                "tandem_worker_engine_step_speed_spread",
                "Root-mean-square relative deviation of a step's measured / modelled seconds "
                "from its fit's mean: the ITL target plans a step two such spreads above the "
                "mean (services/steptime/chunk.py PLAN_SPREADS)", labels=["kind"])
            modelled = CounterMetricFamily(
                "tandem_worker_engine_step_modelled_seconds",
                "The engine's steps as its step-time model prices them, summed, by fit: with "
                "tandem_worker_engine_step_timed_seconds, the speed over any window "
                "(the rate of one over the rate of the other)", labels=["kind"])
            timed = CounterMetricFamily(
                "tandem_worker_engine_step_timed_seconds",
                "The same steps as timed, summed, by fit", labels=["kind"])
            for kind, fit in s.step_speed.fits():
                speed.add_metric([kind], fit.mean)
                spread.add_metric([kind], fit.spread)
                modelled.add_metric([kind], fit.model_s)
                timed.add_metric([kind], fit.timed_s)
            yield speed
            yield spread
            yield modelled
            yield timed
        if s.grammar is not None:
            yield from _grammar_metrics(s.grammar)


def _timing_metrics(t: EngineTimings) -> Iterator[HistogramMetricFamily]:
    steps = HistogramMetricFamily("tandem_worker_engine_step_seconds",
                                  "Wall time of one engine step, by what it computed",
                                  labels=["kind"])
    for kind in StepKind:
        h = t.step_seconds[kind]
        steps.add_metric([kind.name.lower()], h.buckets(), h.total)
    yield steps
    yield from _histograms((
        ("request_queue_seconds", "Time from a request's arrival to its first scheduling",
         t.queue_seconds),
        ("request_prefill_seconds", "Time from a request's first scheduling to its first token",
         t.prefill_seconds),
        ("request_decode_seconds", "Time from a request's first token to its last",
         t.decode_seconds),
    ))


def _grammar_metrics(g: GrammarStats) -> Iterator[CounterMetricFamily | HistogramMetricFamily]:
    yield from _histograms((
        ("grammar_compile_seconds", "Time to compile a structured-output grammar (cache misses)",
         g.compile_seconds),
        ("grammar_mask_fill_seconds", "Time to fill one batch's allowed-token mask",
         g.mask_fill_seconds),
        ("grammar_mask_wait_seconds", "Time a step's sampling waited for its allowed-token mask",
         g.mask_wait_seconds),
    ))
    kinds = CounterMetricFamily("tandem_worker_structured_requests",
                                "Requests with structured output, by kind", labels=["kind"])
    for kind, n in sorted(g.requests_by_kind.items()):
        kinds.add_metric([kind], n)
    yield kinds
    yield CounterMetricFamily("tandem_worker_grammar_errors",
                              "Requests ended because their grammar refused a token",
                              value=g.errors)


def _histograms(items: tuple[tuple[str, str, Histogram], ...]) -> Iterator[HistogramMetricFamily]:
    """One unlabelled ``tandem_worker_<name>`` family per (name, help, histogram)."""
    for name, doc, h in items:
        yield HistogramMetricFamily(f"tandem_worker_{name}", doc, buckets=h.buckets(), sum_value=h.total)
