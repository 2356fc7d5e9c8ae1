"""A simulation with the planner in it: every ``planner.interval_s`` of virtual time the
policy reads ClusterSignals off the simulated cluster and the sim actuator carries out its
decision (workers start, ready ``worker_ready_s`` later, or drain). Without a policy the
same run records the same timeline for a fixed split, so the two compare row by row."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from services.common.config import ClusterConfig
from services.planner.decision import Decision
from services.planner.policy import Policy
from services.sim.actuator import SimActuator
from services.sim.cluster_signals import SignalReader
from services.sim.records import SimResult
from services.sim.report import meets
from services.sim.requests import SimRequest
from services.sim.simulator import Progress, Simulation, TokenMaker, run_sync
from services.steptime.model import StepModel


@dataclass(frozen=True, slots=True)
class IntervalRow:
    """One interval of a run: the split serving at its end (ready workers; ``starting`` and
    ``draining`` on their way), what the policy decided, the interval's TTFT/ITL p90 (None:
    none measured) and goodput (requests sent in it that met both targets / those sent)."""

    t: float
    prefill: int
    decode: int
    starting: int
    draining: int
    action: str
    reason: str
    desired_prefill: int
    desired_decode: int
    ttft_p90_s: float | None
    itl_p90_s: float | None
    decide_s: float  # wall seconds the policy took
    goodput: float | None = None


@dataclass(slots=True)
class PlannedResult:
    result: SimResult
    timeline: list[IntervalRow]
    decisions: list[Decision] = field(default_factory=list)
    moved: set[str] = field(default_factory=set)  # decode requests moved off a draining worker
    reprefilled: int = 0  # of those, prefilled again (their KV did not fit the target)
    leaked_blocks: int = 0
    started: int = 0
    drained: int = 0


def run_planned(cfg: ClusterConfig, requests: list[SimRequest], model: StepModel,
                tokens: TokenMaker, policy: Policy | None, oracle_hit_rate: float = 0.0,
                progress: Progress | None = None, fast_forward: bool = True) -> PlannedResult:
    sim = Simulation(cfg, requests, model, tokens, oracle_hit_rate, progress, fast_forward)
    reader = SignalReader(sim)
    actuator = SimActuator(sim, cfg.planner.worker_ready_s)
    every = cfg.planner.interval_s
    rows: list[IntervalRow] = []
    decisions: list[Decision] = []
    reprefilled: set[str] = set()

    def tick() -> None:
        signals = reader.read()
        current = run_sync(actuator.current())
        desired, action, reason, took = current, "fixed", "", 0.0
        if policy is not None:
            t0 = time.perf_counter()
            d = policy.decide(signals, current)
            took = time.perf_counter() - t0
            decisions.append(d)
            desired, action, reason = d.desired, str(d.action), d.reason
            if d.desired != current:
                run_sync(actuator.apply(d.desired))
        reprefilled.update(sim.reprefilled)
        rows.append(IntervalRow(
            sim.now, sum(1 for p in sim.prefillers if not p.draining), len(sim.decoders),
            len(sim.starting), len(sim.leaving), action, reason, desired.prefill,
            desired.decode, signals.last.ttft_p90_s, signals.last.itl_p90_s, took))
        if sim.unfinished:
            sim.at(sim.now + every, tick)

    sim.at(every, tick)
    result = sim.run()
    rows = with_goodput(rows, result, every)
    return PlannedResult(result, rows, decisions, sim.moved, len(reprefilled),
                         sim.leaked_blocks, actuator.started, actuator.drained)


def with_goodput(rows: list[IntervalRow], result: SimResult, every: float) -> list[IntervalRow]:
    """Each row with the goodput of the requests sent in its interval."""
    sent = [0] * len(rows)
    good = [0] * len(rows)
    for r in result.records:
        i = min(int(r.sent_s // every), len(rows) - 1)
        if i < 0:
            continue
        sent[i] += 1
        good[i] += r.completed and meets(result.slo, r)
    out = []
    for row, n, g in zip(rows, sent, good, strict=True):
        out.append(replace(row, goodput=g / n if n else None))
    return out
