"""`tandem sim`: load the requests, run the simulation (or a sweep of them), report."""

from __future__ import annotations

import argparse
import copy
import functools
import json
import sys
from dataclasses import asdict
from pathlib import Path

from services.bench.results import finish, header, write_json
from services.common.config import ClusterConfig, load_config
from services.planner.policies import policy_for
from services.sim import report, sweep, traces
from services.sim.planned import run_planned
from services.sim.plots import plots
from services.sim.progress import Progress
from services.sim.requests import SimRequest
from services.sim.simulator import simulate
from services.steptime.profile import step_model_for

DEFAULT_BENCH_REQUESTS = 100


def load_requests(args: argparse.Namespace) -> list[SimRequest]:
    """``--trace`` replayed as it is (no ``--workload``), or a bench workload built and
    timed as `tandem bench serve` sends it."""
    if args.workload is None:
        if not args.trace:
            raise ValueError("give --trace FILE to replay a trace, or --workload NAME")
        start = end = None
        if args.window:
            a, sep, b = args.window.partition(":")
            try:
                start = float(a) if a else None
                end = float(b) if b else None
            except ValueError:
                raise ValueError(f"--window {args.window!r}: expected START:END seconds") from None
            if not sep:
                raise ValueError(f"--window {args.window!r}: expected START:END seconds")
        reqs = traces.load_trace(args.trace, args.format)
        return traces.select(reqs, speedup=args.speedup, start_s=start, end_s=end,
                             sample_mod=args.sample_mod, limit=args.num_requests)
    bench_args = copy.copy(args)
    if bench_args.num_requests is None:
        bench_args.num_requests = DEFAULT_BENCH_REQUESTS
    return traces.bench_workload(bench_args)


def config_of(args: argparse.Namespace, overrides: list[str]) -> ClusterConfig:
    overrides = list(overrides)
    if args.slo:
        slo = dict(item.split("=", 1) for item in args.slo)
        overrides.append("sim.slo={" + ", ".join(f"{k}: {v}" for k, v in slo.items()) + "}")
    return load_config(args.config, overrides)


def run_point(args: argparse.Namespace, overrides: list[str], progress: bool = False) -> dict:
    """One simulation of ``args`` with these config overrides: its summary (and, when asked,
    the per-request lines and plots)."""
    cfg = config_of(args, overrides)
    reqs = load_requests(args)
    maker = traces.PromptMaker(cfg.sim.seed)
    oracle = traces.oracle_hit_rate(reqs, cfg.engine.block_size, maker)
    bar = Progress(len(reqs)) if progress else None
    model = step_model_for(cfg)
    planned = None
    try:
        if args.planner or cfg.planner.enabled:
            planned = run_planned(cfg, reqs, model, maker.make, policy_for(cfg, model),
                                  oracle, bar, args.fast_forward)
            result = planned.result
        else:
            result = simulate(cfg, reqs, model, maker.make, oracle, bar, args.fast_forward)
    finally:
        if bar is not None:
            bar.close()
    if args.requests_jsonl:
        report.write_requests(result, args.requests_jsonl)
    if args.plots:
        plots(result, Path(args.plots))
    out = report.summary(result)
    if planned is not None:
        out["planner"] = {"timeline": [asdict(r) for r in planned.timeline],
                          "moved_requests": len(planned.moved),
                          "leaked_kv_blocks": planned.leaked_blocks}
    return out


def _sweep_point(args: argparse.Namespace, overrides: list[str]) -> dict:
    return run_point(args, overrides)


def main(args: argparse.Namespace) -> int:
    head = header(args)
    try:
        if args.sweep:
            points = sweep.parse_sweep(args.sweep)
            for p in points:  # a bad key or value fails here, not in a child process
                config_of(args, sweep.point_overrides(args.overrides, p))
            point_args = copy.copy(args)
            point_args.requests_jsonl = point_args.plots = None  # per run, not per point
            rows = [{"point": point, "summary": summary} for point, summary in sweep.run_sweep(
                args.overrides, points, functools.partial(_sweep_point, point_args),
                args.processes, sys.stdout)]
            result: dict = {"sweep": rows}
        else:
            result = run_point(args, args.overrides, progress=True)
            print(json.dumps(result, indent=2))
    except (ValueError, OSError) as e:
        print(f"tandem sim: {e}", file=sys.stderr)
        return 2
    write_json(args.json_path, finish(head, result))
    return 0
