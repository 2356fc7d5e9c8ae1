"""The planner's Prometheus metrics, in a registry of its own, served on
``planner.metrics_port`` (docs/planner.md, "Running the planner")."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from services.planner.decision import Action, Decision, Split
from services.planner.signals import ClusterSignals, Role


class PlannerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.decisions = Counter(
            "tandem_planner_decisions_total", "Decisions by action and the policy's reason",
            ["action", "reason"], registry=r)
        for action in Action:
            self.decisions.labels(action.value, "none")  # the series exist before the first
        self.desired = Gauge("tandem_planner_desired_replicas",
                             "Workers of a role the last decision wants", ["role"], registry=r)
        self.actual = Gauge("tandem_planner_actual_replicas",
                            "Workers of a role the actuator reports running or starting",
                            ["role"], registry=r)
        self.apply_errors = Counter("tandem_planner_apply_errors_total",
                                    "Splits the actuator failed to apply", registry=r)
        self.adopted = Counter("tandem_planner_adopted_changes_total",
                               "Splits changed by someone else (a hand-scaled Deployment) "
                               "that the planner took as its own", registry=r)
        g = {name: Gauge(f"tandem_planner_{name}", doc, registry=r) for name, doc in (
            ("prefill_queue_tokens", "Prompt tokens waiting in the prefill queue"),
            ("prefill_queue_jobs", "Jobs waiting or running in the prefill queue"),
            ("prefill_queue_oldest_wait_seconds", "Age of the oldest job in the prefill queue"),
            ("arrival_rate", "Requests per second over the last interval"),
            ("mean_input_tokens", "Mean prompt length of the last interval's requests"),
            ("mean_output_tokens", "Mean output length of the last interval's requests"),
            ("ttft_p90_seconds", "TTFT p90 over the last interval (NaN: no first token)"),
            ("itl_p90_seconds", "ITL p90 over the last interval (NaN: no token gap)"),
            ("prefill_tokens_per_second", "Prompt tokens computed per prefill-busy second"),
        )}
        self._g = g

    def record(self, signals: ClusterSignals, decision: Decision) -> None:
        self.decisions.labels(decision.action.value, decision.reason).inc()
        self.set_split(self.desired, decision.desired)
        self.set_split(self.actual, decision.current)
        last, g = signals.last, self._g
        g["prefill_queue_tokens"].set(signals.prefill_queue_tokens)
        g["prefill_queue_jobs"].set(signals.prefill_queue_jobs)
        g["prefill_queue_oldest_wait_seconds"].set(signals.prefill_queue_oldest_wait_s)
        g["arrival_rate"].set(last.arrival_rate)
        g["mean_input_tokens"].set(last.mean_input_tokens)
        g["mean_output_tokens"].set(last.mean_output_tokens)
        g["ttft_p90_seconds"].set(_or_nan(last.ttft_p90_s))
        g["itl_p90_seconds"].set(_or_nan(last.itl_p90_s))
        g["prefill_tokens_per_second"].set(
            last.prefill_tokens_done / last.prefill_busy_s if last.prefill_busy_s > 0 else 0.0)

    @staticmethod
    def set_split(gauge: Gauge, split: Split) -> None:
        gauge.labels(Role.PREFILL.value).set(split.prefill)
        gauge.labels(Role.DECODE.value).set(split.decode)


def _or_nan(v: float | None) -> float:
    return float("nan") if v is None else v
