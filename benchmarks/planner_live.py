"""The planner with real processes on the mock runner: the shifting load of `tandem sim
planner-eval` (services/sim/shifting.py), shortened, replayed by `tandem bench compare`
against three `tandem up` clusters of the same worker budget: the planner (starting from
an even split, moving it through the launcher), the best fixed split of the simulated
eval, and configs/disagg.yaml's 2 prefill + 2 decode. Then goodput (TTFT <= the target
and every inter-token gap <= the target, as the simulator counts it) overall and per
phase, TTFT/ITL p90 per window over time, the planner's decisions from its log, a plot.

    python benchmarks/planner_live.py --budget 8 --phase-s 60 --out benchmarks/results/planner/live_b8
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import shutil
import subprocess
import sys
from datetime import datetime, timedelta
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.bench.metrics import meets_slos  # noqa: E402
from services.common.config import load_config  # noqa: E402
from services.sim.planner_eval import EVAL_SETTINGS, time_scale_settings  # noqa: E402
from services.sim.shifting import shifting, shifting_phases  # noqa: E402

TTFT_MS, ITL_MS = 2000.0, 100.0  # planner.ttft_p90_s / itl_p90_s defaults, the eval's SLO


def write_trace(path: Path, budget: int, phase_s: float, seed: int, time_scale: float) -> list[float]:
    reqs = shifting(shifting_phases(budget, phase_s, time_scale), seed)
    t0 = datetime(2026, 1, 1)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["TIMESTAMP", "ContextTokens", "GeneratedTokens"])
        for r in reqs:
            w.writerow([(t0 + timedelta(seconds=r.arrival_s)).isoformat(timespec="microseconds"),
                        r.input_len, r.output_len])
    return [r.arrival_s for r in reqs]


def runs(budget: int, best: tuple[int, int], interval_s: float, cooldown_s: float,
         lookahead: int | None = None) -> list[str]:
    half = budget // 2
    planner = ",".join([*([f"planner.lookahead_intervals={lookahead}"] if lookahead else []),
                        f"prefill.replicas={half}", f"decode.replicas={budget - half}", "planner.enabled=true",
                        "planner.actuator=local", f"planner.interval_s={interval_s}",
                        f"planner.cooldown_s={cooldown_s}", "planner.min_prefill=1", "planner.min_decode=1",
                        f"planner.max_prefill={budget - 1}", f"planner.max_decode={budget - 1}",
                        f"planner.max_total_workers={budget}"])
    return [f"planner=configs/disagg.yaml@{planner}",
            f"fixed_{best[0]}p{best[1]}d=configs/disagg.yaml@prefill.replicas={best[0]},decode.replicas={best[1]}",
            "default_2p2d=configs/disagg.yaml"]


def good(row: dict, k: float) -> bool:
    """The bench's own SLO rule (``meets_slos``), applied to a request row; the targets
    ``k`` times the planner's (``--time-scale``)."""
    return bool(row["ok"]) and meets_slos({"ttft_ms": TTFT_MS * k, "itl_ms": ITL_MS * k}, row["ttft_ms"],
                                          row["tpot_ms"], row["max_itl_ms"], row["e2e_ms"])


def analyse(result: dict, arrivals: list[float], phase_s: float, window_s: float, k: float) -> dict:
    out: dict = {}
    for name, run in result["runs"].items():
        rows = run["requests"]
        t = np.array([arrivals[r["index"]] for r in rows])
        g = np.array([good(r, k) for r in rows])
        phases = [round(float(g[(t >= i * phase_s) & (t < (i + 1) * phase_s)].mean()), 4) for i in range(3)]
        windows = []
        for w0 in np.arange(0, 3 * phase_s, window_s):
            sel = [r for r, ti in zip(rows, t, strict=True) if w0 <= ti < w0 + window_s and r["ok"]]
            windows.append({"t": float(w0), "ttft_p90_ms": float(np.percentile([r["ttft_ms"] for r in sel], 90)) if sel else None,
                            "max_itl_p90_ms": float(np.percentile([r["max_itl_ms"] or 0 for r in sel], 90)) if sel else None,
                            "goodput": float(np.mean([good(r, k) for r in sel])) if sel else None})
        out[name] = {"requests": len(rows), "failed": int(sum(not r["ok"] for r in rows)),
                     "goodput_fraction": round(float(g.mean()), 4), "phase_goodput": phases,
                     "ttft_p90_ms": run["summary"]["ttft"]["p90"], "itl_p90_ms": run["summary"]["itl"]["p90"],
                     "windows": windows}
    return out


def planner_decisions(run_dir: Path) -> list[str]:
    pat = re.compile(r"(scale_up|scale_down|rebalance|adopt)", re.I)
    return [line.rstrip() for log in sorted(run_dir.glob("**/planner*.log"))
            for line in log.read_text(errors="replace").splitlines() if pat.search(line)]


def plot(res: dict, path: Path, phase_s: float) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    for name, r in res.items():
        t = [w["t"] for w in r["windows"]]
        axes[0].plot(t, [w["goodput"] for w in r["windows"]], label=name)
        axes[1].plot(t, [w["ttft_p90_ms"] for w in r["windows"]], label=name)
        axes[2].plot(t, [w["max_itl_p90_ms"] for w in r["windows"]], label=name)
    for ax, lab in zip(axes, ("goodput (fraction)", "TTFT p90 ms", "max ITL p90 ms"), strict=True):
        ax.set_ylabel(lab)
        for k in (1, 2):
            ax.axvline(k * phase_s, color="grey", lw=0.5)
    axes[1].set_yscale("log")
    axes[2].set_yscale("log")
    axes[2].set_xlabel("arrival time, s (phases: decode-heavy, prefill-heavy, decode-heavy)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--budget", type=int, default=8)
    ap.add_argument("--phase-s", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--best", default="2,6", help="the best fixed split of the simulated eval: prefill,decode")
    ap.add_argument("--interval-s", type=float, default=5.0)
    ap.add_argument("--cooldown-s", type=float, default=10.0)
    ap.add_argument("--lookahead-intervals", type=int, default=None,
                    help="the planner's planner.lookahead_intervals (default: the config's)")
    ap.add_argument("--window-s", type=float, default=10.0)
    ap.add_argument("--time-scale", type=float, default=1.0, metavar="K",
                    help="the mock device K times slower, the load, the SLO and the planner's "
                    "periods stretched with it (time_scale_settings in services/sim/planner_eval.py): "
                    "the per-token CPU of the hops after the engine K times smaller against the "
                    "device's time, as each worker's own host gives it in a real cluster")
    ap.add_argument("--out", default="benchmarks/results/planner/live_b8")
    ap.add_argument("--only", default="", help="comma-separated run names (planner, fixed_PpDd, default_2p2d)")
    a = ap.parse_args()
    if not a.time_scale > 0:
        ap.error(f"--time-scale must be > 0, got {a.time_scale}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    trace = out / "shifting.csv"
    k = a.time_scale
    arrivals = write_trace(trace, a.budget, a.phase_s, a.seed, k)
    # NOTE: --set-all comes after each run's own settings, so it carries the scaled periods
    base = load_config("configs/disagg.yaml", [*EVAL_SETTINGS, f"planner.interval_s={a.interval_s}",
                                               f"planner.cooldown_s={a.cooldown_s}"])
    scaled = time_scale_settings(base, k)
    best = tuple(int(x) for x in a.best.split(","))
    logs = Path("/tmp/planner_live_logs")
    shutil.rmtree(logs, ignore_errors=True)  # the decisions read below are this run's alone
    cmd = [sys.executable, "-m", "services.cli", "bench", "compare",
           *(x for r in runs(a.budget, best, a.interval_s, a.cooldown_s, a.lookahead_intervals)
             if not a.only or r.split("=", 1)[0] in a.only.split(",") for x in ("--run", r)),
           *(x for s in (*EVAL_SETTINGS, *scaled) for x in ("--set-all", s)),
           "--workload", "azure", "--trace", str(trace), "--num-requests", str(len(arrivals)), "--scale", "1", "--arrival", "trace",
           "--slo", f"ttft_ms={TTFT_MS * k:g}", "--slo", f"itl_ms={ITL_MS * k:g}", "--timeout", f"{300 * k:g}",
           "--json", str(out / "compare_full.json"), "--summary-json", str(out / "compare.json"),
           "--log-dir", str(logs)]
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    full = json.loads((out / "compare_full.json").read_text())
    res = analyse(full, arrivals, a.phase_s * k, a.window_s * k, k)
    decisions = planner_decisions(logs / "planner")
    (out / "analysis.json").write_text(json.dumps({"command": " ".join(sys.argv), "slo": {"ttft_ms": TTFT_MS * k, "itl_ms": ITL_MS * k}, "time_scale": k,
                                                   "runs": res, "planner_decisions": decisions}, indent=1))
    (out / "compare_full.json").unlink()  # per-request rows: analysis.json keeps what is reported
    plot(res, out / "over_time.png", a.phase_s * k)
    for name, r in res.items():
        print(f"{name:>16}: goodput {r['goodput_fraction']:.3f}  phases {r['phase_goodput']}  "
              f"failed {r['failed']}/{r['requests']}  TTFT p90 {r['ttft_p90_ms']:.0f} ms  ITL p90 {r['itl_p90_ms']:.0f} ms")
    print(f"planner decisions: {len(decisions)}")
    for d in decisions:
        print("  ", d[-160:])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
