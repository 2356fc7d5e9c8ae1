"""`tandem bench compare`: the same workload against several cluster configs in turn.

For each ``--run NAME=FILE[@key=value,...]`` it starts ``tandem up -c FILE --set ...`` as a
subprocess, waits for the frontend's /health, runs the workload, stops the cluster
(SIGTERM to the launcher, which stops its children) and goes on; then prints every run's
figures and their ratio to the first run (the baseline).
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from services.bench.serve_bench import format_summary, run_and_measure
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


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the cluster exited with code {proc.returncode} before /health")
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url}/health not 200 after {timeout_s:.0f}s")


def stop_cluster(proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_one(spec: RunSpec, args: argparse.Namespace, log_dir: Path) -> dict:
    cfg = load_config(spec.config, list(spec.overrides))
    url = f"http://127.0.0.1:{cfg.frontend.port}"
    argv = [sys.executable, "-m", "services.cli", "up", "-c", spec.config,
            "--run-dir", str(log_dir / spec.name)]
    for o in spec.overrides:
        argv += ["--set", o]
    log = open(log_dir / f"{spec.name}.log", "w")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(url, proc, args.ready_timeout)
        time.sleep(args.settle)  # let discovery spread every worker to the router
        res = run_and_measure(args, url, served_name(cfg))
        res["meta"]["run"] = {"name": spec.name, "config": spec.config,
                              "overrides": list(spec.overrides)}
        return res
    finally:
        stop_cluster(proc)
        log.close()


def main(args: argparse.Namespace) -> int:
    try:
        specs = [RunSpec.parse(t) for t in args.runs]
    except ValueError as e:
        print(f"tandem bench compare: {e}", file=sys.stderr)
        return 2
    if len({s.name for s in specs}) != len(specs) or not specs:
        print("tandem bench compare: give one or more --run with distinct names", file=sys.stderr)
        return 2
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    for spec in specs:
        print(f"== {spec.name}: {spec.config} {' '.join(spec.overrides)}", flush=True)
        results[spec.name] = run_one(spec, args, log_dir)
        print(format_summary(results[spec.name]), flush=True)
    print(ratio_table(results))
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(results, indent=1))
    if args.plot_dir:
        from services.bench.plots import latency_cdfs

        ttft = {n: [r["ttft_ms"] for r in res["requests"] if r["ok"]] for n, res in results.items()}
        itl = {n: res["itl_ms"] for n, res in results.items()}
        for p in latency_cdfs(ttft, itl, args.plot_dir, prefix=args.plot_prefix):
            print(f"wrote {p}")
    return 0
