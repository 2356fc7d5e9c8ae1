"""`tandem bench report FILE.json...`: the markdown rows of docs/benchmarks.md's serving
tables from `bench compare` results, and (``--plot``) their TTFT/ITL CDFs redrawn.

Reads both shapes of compare JSON: ``{"command", "machine", "runs": {...}}`` (now) and a
bare ``{NAME: result}`` (the files in benchmarks/results/serving/ written before the
command line and machine were recorded). Plots need full results (``--json``, with the
samples), not ``--summary-json`` copies.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def runs_of(data: dict) -> dict[str, dict]:
    return data["runs"] if "runs" in data else data


def _f(v: float | None, fmt: str = "{:.0f}") -> str:
    return "n/a" if v is None else fmt.format(v)


def rows(results: dict[str, dict]) -> list[str]:
    """A markdown table: one row per run, mean TTFT as a ratio to the first run's."""
    names = list(results)
    base = results[names[0]]["summary"]
    out = ["| run | done/failed | mean TTFT ms | p99 TTFT ms | p99 ITL ms | goodput req/s "
           "| prefix hit (oracle) | load avg | mean TTFT vs first |",
           "|---|---|---|---|---|---|---|---|---|"]
    for n in names:
        r = results[n]
        s = r["summary"]
        la = r["meta"]["load_average_1m"]
        ratio = base["ttft"]["mean"] / s["ttft"]["mean"] if s["ttft"]["mean"] else None
        out.append(
            f"| {n} | {s['completed']}/{s['failed']} | {_f(s['ttft']['mean'])} "
            f"| {_f(s['ttft']['p99'])} | {_f(s['itl']['p99'])} | {_f(s['goodput'], '{:.2f}')} "
            f"| {_f(s['prefix_hit_rate'], '{:.2f}')} ({r['oracle_prefix_hit_rate']:.2f}) "
            f"| {_f(la['before'], '{:.1f}')}–{_f(la['after'], '{:.1f}')} "
            f"| {_f(ratio, '{:.2f}x')} |")
    return out


def main(args: argparse.Namespace) -> int:
    for path in map(Path, args.files):
        data = json.loads(path.read_text())
        results = runs_of(data)
        machine = data.get("machine") or {}
        print(f"\n{path.name}: {data.get('command', '(command not recorded)')}\n"
              f"machine: {machine.get('cpu_model', 'not recorded')}, {machine.get('cores', '?')} cores\n"
              + "\n".join(rows(results)))
        if args.plot_dir:
            if not all("requests" in r for r in results.values()):
                print(f"tandem bench report: {path} has no per-request rows (a summary): "
                      "not plotted", file=sys.stderr)
                continue
            from services.bench.plots import compare_cdfs

            for p in compare_cdfs(results, args.plot_dir, f"{args.plot_prefix}{path.stem}_"):
                print(f"wrote {p}")
    return 0
