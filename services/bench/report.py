"""`tandem bench report FILE.json...`: the markdown rows of docs/benchmarks.md's serving
tables from `bench compare` results, and (``--plot``) their TTFT/ITL CDFs redrawn.

Reads both shapes of compare JSON: ``{"command", "machine", "runs": {...}}`` (now) and a
bare ``{NAME: result}`` (the files in benchmarks/results/serving/ written before the
command line and machine were recorded). Plots need full results (``--json``, with the
samples), not ``--summary-json`` copies. A rate sweep's file (``--rates``: a ``sweep``
section) gives one row per layout and rate, the comparisons, and its attainment plot
(from either copy).
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


def sweep_rows(sweep: dict) -> list[str]:
    """A markdown table of a rate sweep: one row per layout and rate, each layout's goodput
    on its rows, then one line per comparison against the first layout."""
    out = ["| layout | rate req/s | SLO attainment | TTFT p50 ms | TTFT p99 ms | p99 ITL ms "
           "| req/s | goodput req/s |", "|---|---|---|---|---|---|---|---|"]
    for name, layout in sweep["layouts"].items():
        for p in layout["points"]:
            out.append(f"| {name} | {p['rate']:g} | {p['attainment']:.0%} | {p['ttft_p50_ms']:.0f} "
                       f"| {p['ttft_p99_ms']:.0f} | {p['itl_p99_ms']:.0f} "
                       f"| {p['request_throughput']:.2f} | {layout['goodput_rps']:g} |")
    for c in sweep["comparisons"]:
        at = ("no rate sustained by both" if c["sustained_rate"] is None else
              f"at {c['sustained_rate']:g} req/s TTFT p99 {_f(c['ttft_p99_ratio'], '{:.2f}x')}, "
              f"ITL p99 {_f(c['itl_p99_ratio'], '{:.2f}x')} ({c['baseline']} / {c['run']})")
        out.append(f"\n{c['run']} vs {c['baseline']}: goodput "
                   f"{_f(c['goodput_ratio'], '{:.2f}x')}; {at}")
    return out


def _sweep(path: Path, sweep: dict, args: argparse.Namespace) -> None:
    print("\n".join(sweep_rows(sweep)))
    if args.plot_dir:
        from services.bench.plots import attainment_plot

        series = {n: ([p["rate"] for p in s["points"]], [p["attainment"] for p in s["points"]])
                  for n, s in sweep["layouts"].items()}
        out = Path(args.plot_dir) / f"{args.plot_prefix}{path.stem}_slo_attainment.png"
        print(f"wrote {attainment_plot(series, sweep['attainment_target'], out)}")


def main(args: argparse.Namespace) -> int:
    for path in map(Path, args.files):
        data = json.loads(path.read_text())
        machine = data.get("machine") or {}
        print(f"\n{path.name}: {data.get('command', '(command not recorded)')}\n"
              f"machine: {machine.get('cpu_model', 'not recorded')}, {machine.get('cores', '?')} cores")
        if "sweep" in data:
            _sweep(path, data["sweep"], args)
            continue
        results = runs_of(data)
        print("\n".join(rows(results)))
        if args.plot_dir:
            if not all("requests" in r for r in results.values()):
                print(f"tandem bench report: {path} has no per-request rows (a summary): "
                      "not plotted", file=sys.stderr)
                continue
            from services.bench.plots import compare_cdfs

            for p in compare_cdfs(results, args.plot_dir, f"{args.plot_prefix}{path.stem}_"):
                print(f"wrote {p}")
    return 0
