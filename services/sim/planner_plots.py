"""The planner evaluation's plots: the planner's split over time, and TTFT p90, ITL p90 and
goodput per interval for the planner (and its other policy), the best fixed split and the
default split, the
workload's phases shaded; and each run's goodput (matplotlib, as services/sim/plots.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.bench.plots import pyplot


def _series(run: dict[str, Any], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for row in run["timeline"]:
        if row[key] is not None:
            xs.append(row["t"])
            ys.append(row[key])
    return xs, ys


def planner_plots(result: dict[str, Any], out_dir: Path, prefix: str) -> list[Path]:
    plt = pyplot()
    runs = result["runs"]
    plan = runs[0]
    best = next(r for r in runs if r["run"] == result["verdict"]["best_fixed"])
    default = runs[-1]
    shown = [(plan, "C0"), (best, "C1"), (default, "C2")]
    shown += [(r, "C3") for r in runs[1:] if r["run"].startswith("planner (")]
    fig, axes = plt.subplots(4, 1, figsize=(8, 10), dpi=90, sharex=True)
    t0 = 0.0
    for k, ph in enumerate(result["phases"]):
        for ax in axes:
            if k % 2:
                ax.axvspan(t0, t0 + ph["duration_s"], color="0.92", zorder=0)
        t0 += ph["duration_s"]
    ax = axes[0]
    t = [r["t"] for r in plan["timeline"]]
    ax.step(t, [r["prefill"] for r in plan["timeline"]], where="post", label="prefill ready")
    ax.step(t, [r["decode"] for r in plan["timeline"]], where="post", label="decode ready")
    ax.step(t, [r["desired_prefill"] for r in plan["timeline"]], where="post", ls=":",
            color="C0", label="prefill desired")
    ax.step(t, [r["desired_decode"] for r in plan["timeline"]], where="post", ls=":",
            color="C1", label="decode desired")
    ax.set_ylabel("workers")
    ax.set_title(f"planner's split, budget {result['budget']} (shaded: long prompts, "
                 "short outputs)")
    for ax, key, label, scale, target in (
            (axes[1], "ttft_p90_s", "TTFT p90 (s)", 1.0, "ttft_ms"),
            (axes[2], "itl_p90_s", "ITL p90 (ms)", 1000.0, "itl_ms"),
            (axes[3], "goodput", "goodput (fraction)", 1.0, None)):
        for run, color in shown:
            xs, ys = _series(run, key)
            ax.plot(xs, [y * scale for y in ys], color=color, label=run["run"], lw=1.2)
        ax.set_ylabel(label)
        if key == "ttft_p90_s":
            ax.set_yscale("log")
        if target is not None:
            slo_ms = result["slo"].get(target)
            if slo_ms is not None:  # ms; the axis is in seconds times ``scale``
                ax.axhline(slo_ms / 1000.0 * scale, color="k", ls="--", lw=0.8, label="target")
    axes[3].set_xlabel("virtual time (s)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    over_time = out_dir / f"{prefix}over_time.png"
    fig.savefig(over_time)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(8, 3.2), dpi=90)
    names = [r["run"] for r in runs]
    ax.bar(range(len(runs)), [r["goodput_fraction"] for r in runs],
           color=["C0" if n == "planner" else "C3" if n.startswith("planner (")
                  else "C2" if n.startswith("default") else "C7" for n in names])
    ax.set_xticks(range(len(runs)))
    ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("goodput (fraction of requests)")
    ax.set_title(f"goodput by split, budget {result['budget']}")
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    bars = out_dir / f"{prefix}goodput.png"
    fig.savefig(bars)
    plt.close(fig)
    return [over_time, bars]
