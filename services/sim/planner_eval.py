"""`tandem sim planner-eval`: the planner against every fixed split of the same worker
budget and against the split of the config (configs/disagg.yaml: 2 prefill + 2 decode), on
the shifting workload (services/sim/shifting.py), in the simulator.

Every run shares one config: the given one with the mock runner's step model
(``engine.step_model: mock``) and the settings below (EVAL_SETTINGS: why each), the SLO of
the goodput rule set from the planner's targets (``sim.slo`` ttft_ms = ttft_p90_s, itl_ms =
itl_p90_s: a request is good when its TTFT and its largest inter-token gap are within them,
services/sim/report.py), and the planner's bounds from the budget (min 1 of each role, at
most budget - 1 of either, budget in all). The planner starts from an even split; it runs
with the config's ``planner.policy`` (the verdict's) and with the other policy beside it.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from services.bench.results import finish, header, write_json
from services.common.config import ClusterConfig, load_config
from services.planner.policies import policy_for
from services.sim.planned import PlannedResult, run_planned
from services.sim.report import meets, summary
from services.sim.shifting import Phase, shifting, shifting_phases
from services.sim.traces import PromptMaker
from services.steptime.profile import step_model_for

# Remote prefill as the planner's models see it: every prompt past
# max_local_prefill_length goes to the prefill queue (policy threshold, queue bounds out of
# the way), and a prefill worker takes one job at a time (the mock device's cost is linear
# in tokens: batching jobs gains nothing and delays each first token). Under the default
# "predict" policy and an 8-job queue bound the decode workers prefill much of the load
# themselves, whatever the split: the split the planner moves then means less.
EVAL_SETTINGS = ("engine.runner=mock", "engine.step_model=mock",
                 "decode.disagg.policy=threshold", "decode.disagg.max_prefill_queue_size=256",
                 "decode.disagg.max_prefill_queue_tokens=1000000",
                 "prefill.max_concurrent_jobs=1")


def time_scale_settings(base: ClusterConfig, k: float) -> list[str]:
    """Settings that run ``base`` on a mock device ``k`` times slower, with every target and
    period that is the device's time stretched with it (the load's side is
    ``shifting_phases``'s ``time_scale``). On a host whose few cores every worker shares,
    the per-token CPU of the hops after the engine (processor, frontend, the workers' event
    loops) is then ``k`` times smaller against the device's time: what each worker's own
    host gives it in a real cluster. A worker's start-up stays real time, so it is ``k``
    times shorter against the device's (docs/planner.md)."""
    if k == 1:
        return []
    m, pl, e = base.engine.mock, base.planner, base.engine
    out = [f"engine.mock.step_base_s={m.step_base_s * k:g}",
           f"engine.mock.per_prefill_token_s={m.per_prefill_token_s * k:g}",
           f"engine.mock.per_decode_seq_s={m.per_decode_seq_s * k:g}",
           f"planner.ttft_p90_s={pl.ttft_p90_s * k:g}", f"planner.itl_p90_s={pl.itl_p90_s * k:g}",
           f"planner.interval_s={pl.interval_s * k:g}", f"planner.cooldown_s={pl.cooldown_s * k:g}",
           f"planner.scale_down_window_s={pl.scale_down_window_s * k:g}",
           f"planner.hedge_window_s={pl.hedge_window_s * k:g}"]
    if e.itl_target_ms:
        out.append(f"engine.itl_target_ms={e.itl_target_ms * k:g}")
    if e.lone_step_target_ms:
        out.append(f"engine.lone_step_target_ms={e.lone_step_target_ms * k:g}")
    return out


def eval_config(path: str | None, overrides: list[str], budget: int, p: int, d: int) -> ClusterConfig:
    base = load_config(path, [*EVAL_SETTINGS, *overrides])
    pl = base.planner
    return load_config(path, [
        *EVAL_SETTINGS, *overrides, f"prefill.replicas={p}", f"decode.replicas={d}",
        f"sim.slo={{ttft_ms: {pl.ttft_p90_s * 1000:g}, itl_ms: {pl.itl_p90_s * 1000:g}}}",
        "planner.min_prefill=1", "planner.min_decode=1", f"planner.max_prefill={budget - 1}",
        f"planner.max_decode={budget - 1}", f"planner.max_total_workers={budget}"])


def _run(cfg: ClusterConfig, phases: list[Phase], seed: int,
         policy_name: str | None) -> PlannedResult:
    """One run; ``policy_name`` None: the split of ``cfg`` throughout."""
    reqs = shifting(phases, seed)
    if policy_name is not None:
        cfg = cfg.model_copy(update={"planner": cfg.planner.model_copy(
            update={"policy": policy_name})})
    model = step_model_for(cfg)
    policy = policy_for(cfg, model) if policy_name is not None else None
    return run_planned(cfg, reqs, model, PromptMaker(cfg.sim.seed).make, policy)


def _row(name: str, pr: PlannedResult, phase_s: float) -> dict[str, Any]:
    s = summary(pr.result)
    recs = pr.result.records
    good = [r.completed and meets(pr.result.slo, r) for r in recs]
    phases = []
    for k in range(3):
        idx = [i for i, r in enumerate(recs) if k * phase_s <= r.sent_s < (k + 1) * phase_s]
        phases.append(round(sum(good[i] for i in idx) / len(idx), 4) if idx else None)
    row: dict[str, Any] = {
        "run": name, "requests": s["requests"], "failed": s["failed"],
        "goodput_fraction": round(sum(good) / len(recs), 4) if recs else 0.0,
        "goodput_rps": s["goodput_rps"], "phase_goodput": phases,
        "ttft_p90_ms": s["ttft_ms"]["p90"], "itl_p90_ms": s["itl_ms"]["p90"],
        "duration_s": s["duration_s"], "wall_s": s["wall_s"],
        "timeline": [asdict(t) for t in pr.timeline]}
    if pr.decisions:
        took = [t.decide_s for t in pr.timeline]
        moved = [r for r in recs if f"r{r.index}" in pr.moved]
        counts: dict[str, int] = {}
        for d in pr.decisions:
            key = f"{d.action}/{d.reason}"
            counts[key] = counts.get(key, 0) + 1
        row["planner"] = {
            "decisions": counts, "workers_started": pr.started, "workers_drained": pr.drained,
            "moved_requests": len(moved), "moved_reprefilled": pr.reprefilled,
            "moved_failed": sum(not r.completed for r in moved),
            "moved_tokens_short": sum(r.output_tokens - r.tokens_out for r in moved),
            "moved_max_gap_ms": _pcts([r.max_gap_s * 1000 for r in moved]),
            "unmoved_max_gap_ms": _pcts([r.max_gap_s * 1000 for r in recs
                                         if r.completed and f"r{r.index}" not in pr.moved]),
            "leaked_kv_blocks": pr.leaked_blocks,
            "decide_ms": {"p50": round(float(np.median(took)) * 1000, 2),
                          "max": round(max(took) * 1000, 2)}}
    return row


def _pcts(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {}
    p50, p99 = np.percentile(xs, [50, 99])
    return {"p50": round(float(p50), 1), "p99": round(float(p99), 1), "n": len(xs)}


def evaluate(args: argparse.Namespace, budget: int, out: Path) -> dict[str, Any]:
    base0 = load_config(args.config, [*EVAL_SETTINGS, *args.overrides])
    # NOTE: the scaled values last: they are the given ones (base0 took them in) times K
    overrides = [*args.overrides, *time_scale_settings(base0, args.time_scale)]
    phases = shifting_phases(budget, args.phase_s, args.time_scale)
    phase_s = phases[0].duration_s  # wall seconds of one phase

    def cfg(p: int, d: int) -> ClusterConfig:
        return eval_config(args.config, overrides, budget, p, d)

    runs: list[dict[str, Any]] = []
    half = budget // 2
    # the config's policy first (the one the verdict is about), then the other one
    first = load_config(args.config, [*EVAL_SETTINGS, *args.overrides]).planner.policy
    policies = (first,) if args.only == "planner" else (
        first, "formula" if first == "simulate" else "simulate")
    for name in policies:
        label = "planner" if name == first else f"planner ({name})"
        print(f"budget {budget}: {label}", file=sys.stderr, flush=True)
        runs.append(_row(label, _run(cfg(half, budget - half), phases, args.seed, name), phase_s))
    result = {"budget": budget, "phases": [asdict(p) for p in phases], "time_scale": args.time_scale,
              "seed": args.seed, "settings": list(EVAL_SETTINGS), "overrides": overrides,
              "slo": dict(cfg(half, budget - half).sim.slo),
              "planner_config": cfg(half, budget - half).planner.model_dump(),
              "verdict": None, "runs": runs}
    if args.only == "planner":
        return result  # a policy's iteration: no fixed splits to compare, no plots
    default = (base0.prefill.replicas, base0.decode.replicas)
    for p in range(1, budget):
        print(f"budget {budget}: fixed {p}p{budget - p}d", file=sys.stderr, flush=True)
        runs.append(_row(f"fixed {p}p{budget - p}d", _run(cfg(p, budget - p), phases, args.seed,
                                                            None), phase_s))
    print(f"budget {budget}: default {default[0]}p{default[1]}d", file=sys.stderr, flush=True)
    runs.append(_row(f"default {default[0]}p{default[1]}d", _run(cfg(*default), phases,
                                                                args.seed, None), phase_s))
    fixed = [r for r in runs if r["run"].startswith("fixed")]
    best = max(fixed, key=lambda r: r["goodput_fraction"])
    plan, dflt = runs[0], runs[-1]
    result["verdict"] = {
        "best_fixed": best["run"],
        "planner_vs_best_fixed": _ratio(plan, best),
        "planner_vs_default": _ratio(plan, dflt),
        "target_met": (plan["goodput_fraction"] >= best["goodput_fraction"]
                       and plan["goodput_fraction"] >= 1.5 * dflt["goodput_fraction"])}
    from services.sim.planner_plots import planner_plots
    planner_plots(result, out, f"budget{budget}_")
    return result


def _ratio(a: dict[str, Any], b: dict[str, Any]) -> float | None:
    return round(a["goodput_fraction"] / b["goodput_fraction"], 3) if b["goodput_fraction"] else None


def main(args: argparse.Namespace) -> int:
    head = header(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        budgets = [int(x) for x in args.budgets.split(",")]
        if any(b < 2 for b in budgets):
            raise ValueError("--budgets: each budget must be at least 2 workers")
        for b in budgets:
            result = evaluate(args, b, out)
            write_json(out / f"budget{b}.json", finish(head, result))
            table = [{k: r[k] for k in ("run", "goodput_fraction", "phase_goodput",
                                        "ttft_p90_ms", "itl_p90_ms", "failed")}
                     for r in result["runs"]]
            print(json.dumps({"budget": b, "verdict": result["verdict"], "runs": table},
                             indent=1))
    except (ValueError, OSError) as e:
        print(f"tandem sim planner-eval: {e}", file=sys.stderr)
        return 2
    return 0
