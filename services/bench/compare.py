"""`tandem bench compare`: the same workload against several cluster configs in turn.

For each ``--run NAME=FILE[@key=value,...]`` (or each run of ``--preset``) it starts
``tandem up -c FILE --set ...`` as a subprocess, waits for the frontend's /health, runs the
workload, stops the cluster (SIGTERM to the launcher, which stops its children) and goes
on; then prints every run's figures and their ratio to the first run (the baseline).

The JSON is ``{"command", "machine", "runs": {NAME: result}}``, each result as `bench
serve` writes it; ``--summary-json`` leaves out the per-request rows and ITL samples.

With ``--rates`` each run's cluster is started once and driven at every rate in turn
(services/bench/rate_sweep.py); the tables are then SLO attainment by rate per run, each
run's goodput (the highest rate it sustains), and each run against the first.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from services.bench.cluster import running_cluster
from services.bench.metrics import parse_slos
from services.bench.rate_sweep import report, run_rates
from services.bench.results import header, write_json
from services.bench.serve import build_workload, format_summary, run_and_measure, slim
from services.bench.sweep import check_sweep, parse_rates
from services.common.config import load_config
from services.launcher.up import served_name

# (label, summary path) of the figures compared; lower is better for latencies.
FIGURES = (("mean TTFT ms", ("ttft", "mean")), ("p99 TTFT ms", ("ttft", "p99")),
           ("p99 ITL ms", ("itl", "p99")), ("mean TPOT ms", ("tpot", "mean")),
           ("out tok/s", ("output_throughput",)), ("goodput req/s", ("goodput",)),
           ("prefix hit rate", ("prefix_hit_rate",)))


@dataclass(frozen=True)
class RunSpec:
    name: str
    config: str
    overrides: tuple[str, ...]

    @staticmethod
    def parse(text: str) -> RunSpec:
        """``NAME=FILE`` or ``NAME=FILE@key=value,key=value``."""
        name, sep, rest = text.partition("=")
        if not sep or not name or not rest:
            raise ValueError(f"--run {text!r}: expected NAME=FILE[@key=value,...]")
        path, _, sets = rest.partition("@")
        overrides = tuple(s for s in sets.split(",") if s)
        if any("=" not in s for s in overrides):
            raise ValueError(f"--run {text!r}: overrides must be key=value")
        return RunSpec(name, path, overrides)


def _figure(summary: dict, path: tuple[str, ...]) -> float | None:
    v: object = summary
    for k in path:
        v = v.get(k) if isinstance(v, dict) else None
    return v if isinstance(v, (int, float)) else None


def ratio_table(results: dict[str, dict]) -> str:
    """Each figure per run, and baseline / run for latencies (how many times lower) or
    run / baseline for throughputs and hit rates (how many times higher)."""
    names = list(results)
    base = results[names[0]]["summary"]
    lines = [f"{'figure':18s}" + "".join(f"{n:>22s}" for n in names)]
    for label, path in FIGURES:
        b = _figure(base, path)
        row = f"{label:18s}"
        for n in names:
            v = _figure(results[n]["summary"], path)
            if v is None:
                row += f"{'n/a':>22s}"
                continue
            lower_better = path[0] in ("ttft", "itl", "tpot", "e2e")
            r = (b / v if lower_better else v / b) if b and v else None
            row += f"{v:>12.3f}" + (f" ({r:5.2f}x)" if r is not None and n != names[0] else " " * 9)
        lines.append(row)
    lines.append(f"(ratios vs {names[0]}: latencies baseline/run, throughputs run/baseline)")
    return "\n".join(lines)


@contextmanager
def _cluster(spec: RunSpec, args: argparse.Namespace, log_dir: Path) -> Iterator[tuple[str, str]]:
    """The run's cluster, up: yields its frontend URL and served model name."""
    cfg = load_config(spec.config, list(spec.overrides))
    url = f"http://127.0.0.1:{cfg.frontend.port}"
    with running_cluster(spec.config, spec.overrides, url, log_dir / spec.name,
                         log_dir / f"{spec.name}.log", args.ready_timeout, args.settle):
        yield url, served_name(cfg)


def _run_meta(spec: RunSpec) -> dict:
    return {"name": spec.name, "config": spec.config, "overrides": list(spec.overrides)}


def run_one(spec: RunSpec, args: argparse.Namespace, log_dir: Path) -> dict:
    with _cluster(spec, args, log_dir) as (url, model):
        res = run_and_measure(args, url, model, build_workload(args))
    res["meta"]["run"] = _run_meta(spec)
    return res


def run_sweep(spec: RunSpec, args: argparse.Namespace, log_dir: Path,
              rates: Sequence[float]) -> list[dict]:
    """One result per rate, all from one start of the run's cluster."""
    with _cluster(spec, args, log_dir) as (url, model):
        results = run_rates(args, url, model, rates)
    for res in results:
        res["meta"]["run"] = _run_meta(spec)
    return results


def _specs(args: argparse.Namespace) -> list[RunSpec]:
    """The runs (explicit ``--run``s, else the preset's) with ``--set-all`` added to each;
    the workload and SLOs are checked too, before any cluster is started."""
    specs = [RunSpec.parse(t) for t in (args.runs or args.preset_runs)]
    if not specs or len({s.name for s in specs}) != len(specs):
        raise ValueError("give one or more --run (or a --preset) with distinct names")
    bad = [o for o in args.set_all if "=" not in o]
    if bad:
        raise ValueError(f"--set-all {bad[0]!r}: expected KEY=VALUE")
    build_workload(args)
    slos = parse_slos(args.slo)
    if args.rates is not None:
        check_sweep(slos, args.attainment, args.arrival)
    return [RunSpec(s.name, s.config, (*s.overrides, *args.set_all)) for s in specs]


def main(args: argparse.Namespace) -> int:
    head = header(args)
    try:
        rates = None if args.rates is None else parse_rates(args.rates)
        specs = _specs(args)
    except (ValueError, OSError) as e:
        print(f"tandem bench compare: {e}", file=sys.stderr)
        return 2
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    if rates is not None:
        runs: dict[str, list[dict]] = {}
        for spec in specs:
            print(f"== {spec.name}: {spec.config} {' '.join(spec.overrides)}", flush=True)
            runs[spec.name] = run_sweep(spec, args, log_dir, rates)
        report(head, runs, rates, args)
        return 0
    results: dict[str, dict] = {}
    for spec in specs:
        print(f"== {spec.name}: {spec.config} {' '.join(spec.overrides)}", flush=True)
        results[spec.name] = run_one(spec, args, log_dir)
        print(format_summary(results[spec.name]), flush=True)
    print(ratio_table(results))
    write_json(args.json_path, {**head, "runs": results})
    write_json(args.summary_json, {**head, "runs": {n: slim(r) for n, r in results.items()}})
    if args.plot_dir:
        from services.bench.plots import compare_cdfs

        for p in compare_cdfs(results, args.plot_dir, args.plot_prefix):
            print(f"wrote {p}")
    return 0
