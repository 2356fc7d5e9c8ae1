"""TTFT and ITL CDF plots (matplotlib, Agg backend: no display needed).

matplotlib is an optional dependency (the ``bench`` extra); it is imported only through
``pyplot()`` (the simulator's plots too).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend; RuntimeError naming the extra without it."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("plots need matplotlib: pip install 'tandem[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def cdf_plot(series: Mapping[str, Sequence[float]], xlabel: str, title: str, path: str | Path) -> Path:
    """One CDF line per named series of values (ms); writes a small PNG to ``path``."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.2), dpi=90)
    lo, hi = np.inf, 0.0
    for name, values in series.items():
        if not len(values):
            continue
        xs = np.sort(np.asarray(values, dtype=np.float64))
        ys = np.arange(1, len(xs) + 1) / len(xs)
        ax.step(xs, ys, where="post", label=name)
        lo, hi = min(lo, xs[0]), max(hi, xs[-1])
    if lo > 0 and hi / lo > 100:  # latencies spanning decades: a log axis shows the body
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of samples")
    ax.set_title(title)
    ax.set_ylim(0, 1.01)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    return _save(fig, path)


def latency_cdfs(ttft_ms: Mapping[str, Sequence[float]], itl_ms: Mapping[str, Sequence[float]],
                 out_dir: str | Path, prefix: str = "") -> list[Path]:
    """``{prefix}ttft_cdf.png`` and ``{prefix}itl_cdf.png`` under ``out_dir``."""
    d = Path(out_dir)
    return [cdf_plot(ttft_ms, "TTFT (ms)", "time to first token", d / f"{prefix}ttft_cdf.png"),
            cdf_plot(itl_ms, "ITL (ms)", "inter-token latency", d / f"{prefix}itl_cdf.png")]


def compare_cdfs(runs: Mapping[str, Mapping], out_dir: str | Path, prefix: str = "") -> list[Path]:
    """``latency_cdfs`` of `bench compare` runs (full results: they hold the samples)."""
    ttft = {n: [r["ttft_ms"] for r in res["requests"] if r["ok"]] for n, res in runs.items()}
    itl = {n: res["itl_ms"] for n, res in runs.items()}
    return latency_cdfs(ttft, itl, out_dir, prefix)


def attainment_plot(series: Mapping[str, tuple[Sequence[float], Sequence[float]]], target: float,
                    path: str | Path) -> Path:
    """SLO attainment against request rate, one line per layout (NAME -> (rates,
    attainments)), the target as a dashed line; writes a small PNG to ``path``."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.2), dpi=90)
    for name, (rates, attained) in series.items():
        ax.plot(rates, attained, marker="o", label=name)
    ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target:.0%}")
    rates = sorted({r for rs, _ in series.values() for r in rs})
    if rates and rates[-1] >= 4 * rates[0]:  # doubling rates: a log axis spaces them evenly
        ax.set_xscale("log", base=2)
        ax.set_xticks(rates, [f"{r:g}" for r in rates])
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLO attainment")
    ax.set_title("share of requests meeting every SLO")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower left", fontsize=8)
    return _save(fig, path)


def budget_plot(points: Sequence[Mapping[str, Any]], path: str | Path) -> Path:
    """`bench budget`'s sweep: ITL p99 over the decode-only step (left) and the long prompts'
    TTFT p50 (right) against the ITL target, one line per token budget; 2x dashed."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(8, 3.2), dpi=90)
    budgets = sorted({p["max_num_batched_tokens"] for p in points})
    targets = sorted({p["itl_target_ms"] for p in points})
    xs = range(len(targets))
    for b in budgets:
        by = {p["itl_target_ms"]: p for p in points if p["max_num_batched_tokens"] == b}
        left.plot(xs, [by[t]["itl_p99_over_decode_step"] if t in by else np.nan for t in targets],
                  marker="o", label=f"budget {b}")
        right.plot(xs, [by[t]["ttft_long_ms"]["p50"] if t in by else np.nan for t in targets],
                   marker="o", label=f"budget {b}")
    left.axhline(2.0, color="grey", linestyle="--", linewidth=1, label="2x")
    left.set_yscale("log")
    left.set_ylabel("ITL p99 / decode-only step")
    right.set_ylabel("long prompt TTFT p50 (ms)")
    for ax in (left, right):
        ax.set_xticks(list(xs), [f"{t:g}" if t else "off" for t in targets])
        ax.set_xlabel("engine.itl_target_ms")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path)


def _save(fig: Any, path: str | Path) -> Path:
    """Write ``fig`` to ``path`` (its folder made) and free it."""
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    pyplot().close(fig)
    return out
