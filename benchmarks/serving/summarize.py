"""Markdown rows from `tandem bench compare --json` files, and slim copies of them (the
summaries without per-request rows) for benchmarks/results/serving/.

Usage: python benchmarks/serving/summarize.py OUT_DIR RESULT.json...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _f(v: float | None, fmt: str = "{:.0f}") -> str:
    return "n/a" if v is None else fmt.format(v)


def rows(results: dict[str, dict]) -> list[str]:
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


def main() -> None:
    out_dir = Path(sys.argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    for path in map(Path, sys.argv[2:]):
        results = json.loads(path.read_text())
        print(f"\n{path.name}\n" + "\n".join(rows(results)))
        slim = {n: {"meta": r["meta"], "summary": r["summary"],
                    "oracle_prefix_hit_rate": r["oracle_prefix_hit_rate"]}
                for n, r in results.items()}
        (out_dir / path.name).write_text(json.dumps(slim, indent=1))


if __name__ == "__main__":
    main()
