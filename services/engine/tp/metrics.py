"""``tandem_worker_tp_*`` metrics of a tensor-parallel worker, read at scrape time from the
entry runner (rank 0's own clocks and the other ranks' shared stats arrays)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from services.engine.tp.runner import TpRunner


class TpCollector(Collector):
    def __init__(self, runner: TpRunner) -> None:
        self._runner = runner

    def collect(self) -> Iterator[CounterMetricFamily]:
        steps = CounterMetricFamily("tandem_worker_tp_steps", "Forward steps run, per TP rank", labels=["rank"])
        wait = CounterMetricFamily(
            "tandem_worker_tp_broadcast_wait_seconds",
            "Time blocked on request payload broadcasts, per TP rank (rank 0: submitting them; "
            "others: waiting for one a step needs); divide by steps for the per-step wait",
            labels=["rank"])
        reduce = CounterMetricFamily("tandem_worker_tp_all_reduce_seconds",
                                     "Time in the forward's all-reduces, per TP rank", labels=["rank"])
        for s in self._runner.rank_stats():
            r = str(s.rank)
            steps.add_metric([r], s.steps)
            wait.add_metric([r], s.broadcast_wait_seconds)
            reduce.add_metric([r], s.all_reduce_seconds)
        yield steps
        yield wait
        yield reduce
        yield CounterMetricFamily("tandem_worker_tp_failures",
                                  "TP ranks that died, or collectives that failed or timed out",
                                  value=self._runner.num_failures)
