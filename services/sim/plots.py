"""A simulation's plots (matplotlib, Agg backend): TTFT and ITL CDFs, each decode worker's
requests and KV use over virtual time, the prefill tokens waiting, and the cluster's prefix
hit rate over time.

Many workers: a plot shows the mean over workers, the band between the least and the most
loaded, and a few of the busiest workers' own lines, so 64 workers stay readable.
matplotlib is optional (the ``bench`` extra), imported only when plotting.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from services.bench.plots import pyplot
from services.sim.records import HitSample, SimResult, WorkerSample

# Above this many workers a plot draws the band and only the busiest few by name.
_ALL_LINES_UP_TO = 8
_NAMED_LINES = 4
_CDF_POINTS = 2000  # a CDF line is drawn through at most about this many points
_HIT_WINDOWS = 50  # the windowed hit rate averages over duration / this


def _save(plt: Any, fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _over_time(ax: Any, ylabel: str, title: str) -> None:
    ax.set_xlabel("virtual time (s)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)


def _no_data(ax: Any) -> None:
    ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)


def _cdf(plt: Any, values: np.ndarray, counts: np.ndarray, xlabel: str, title: str,
         path: Path) -> Path:
    """The CDF of ``values`` each repeated ``counts`` times (without repeating them)."""
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=100)
    keep = counts > 0
    v, c = values[keep], counts[keep]
    if len(v):
        order = np.argsort(v, kind="stable")
        xs = v[order]
        ys = np.cumsum(c[order]) / c.sum()
        if len(xs) > _CDF_POINTS:
            # The last point of each 1/_CDF_POINTS step of the CDF (and the maximum).
            idx = np.unique(np.searchsorted(ys, np.linspace(0, 1, _CDF_POINTS + 1)[1:]))
            idx = np.minimum(idx, len(xs) - 1)
            xs, ys = xs[idx], ys[idx]
        ax.step(xs, ys, where="post")
        if xs[0] > 0 and xs[-1] / xs[0] > 100:  # spanning decades: a log axis shows the body
            ax.set_xscale("log")
    else:
        _no_data(ax)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of samples")
    ax.set_title(title)
    ax.set_ylim(0, 1.01)
    ax.grid(alpha=0.3)
    return _save(plt, fig, path)


def worker_matrix(samples: Sequence[WorkerSample], field: str
                  ) -> tuple[np.ndarray, list[str], np.ndarray]:
    """(times, workers, values[time, worker]) of one sample field (or ``"load"``: running +
    waiting, ``"kv_use"``: blocks used / total); NaN where a worker has no sample then."""
    times = np.unique(np.fromiter((s.t_s for s in samples), dtype=np.float64, count=len(samples)))
    workers = list(dict.fromkeys(s.worker for s in samples))
    col = {w: i for i, w in enumerate(workers)}
    out = np.full((len(times), len(workers)), np.nan)
    rows = np.searchsorted(times, [s.t_s for s in samples])
    for row, s in zip(rows, samples, strict=True):
        if field == "load":
            x: float = s.running + s.waiting
        elif field == "kv_use":
            x = s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0
        else:
            x = getattr(s, field)
        out[row, col[s.worker]] = x
    return times, workers, out


def _per_worker(plt: Any, samples: Sequence[WorkerSample], field: str, ylabel: str, title: str,
                path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(8, 4), dpi=100)
    if samples:
        t, workers, m = worker_matrix(samples, field)
        if len(workers) <= _ALL_LINES_UP_TO:
            for i, w in enumerate(workers):
                ax.plot(t, m[:, i], lw=1, label=w)
        else:
            ax.fill_between(t, np.nanmin(m, axis=1), np.nanmax(m, axis=1), alpha=0.25,
                            step="post", label=f"min-max of {len(workers)} workers")
            ax.plot(t, np.nanmean(m, axis=1), color="black", lw=1.5, drawstyle="steps-post",
                    label="mean")
            busiest = np.argsort(-np.nan_to_num(np.nanmean(m, axis=0)), kind="stable")
            for i in busiest[:_NAMED_LINES]:
                ax.plot(t, m[:, i], lw=0.7, alpha=0.8, drawstyle="steps-post",
                        label=workers[i])
        ax.legend(loc="upper right", fontsize=7, ncol=2)
    else:
        _no_data(ax)
    _over_time(ax, ylabel, title)
    return _save(plt, fig, path)


def _queue(plt: Any, samples: Sequence[WorkerSample], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(8, 4), dpi=100)
    if samples:
        t, _, m = worker_matrix(samples, "prefill_tokens_pending")
        ax.plot(t, np.nansum(m, axis=1), lw=1, drawstyle="steps-post", label="all workers")
        ax.plot(t, np.nanmax(m, axis=1), lw=0.8, drawstyle="steps-post",
                label="the most on one worker")
        ax.legend(loc="upper right", fontsize=8)
    else:
        _no_data(ax)
    _over_time(ax, "prompt tokens", "prefill tokens pending on decode workers")
    return _save(plt, fig, path)


def windowed_hit_rate(samples: Sequence[HitSample], window_s: float
                      ) -> tuple[np.ndarray, np.ndarray]:
    """(times, hit rate over the ``window_s`` before each sample; NaN where no prompt
    tokens were admitted in it) from cumulative samples."""
    t = np.array([s.t_s for s in samples], dtype=np.float64)
    prompt = np.array([s.prompt_tokens for s in samples], dtype=np.float64)
    hit = np.array([s.hit_tokens for s in samples], dtype=np.float64)
    start = np.searchsorted(t, t - window_s, side="left")
    dp = prompt - prompt[start]
    dh = hit - hit[start]
    with np.errstate(invalid="ignore", divide="ignore"):
        rate = np.where(dp > 0, dh / dp, np.nan)
    return t, rate


def _hit_rate(plt: Any, result: SimResult, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(8, 4), dpi=100)
    samples = result.hit_samples
    if samples:
        span = samples[-1].t_s - samples[0].t_s
        window = max(span / _HIT_WINDOWS, 1e-9)
        t, rate = windowed_hit_rate(samples, window)
        ax.plot(t, rate, lw=1, label=f"over the last {window:.3g} s")
        p = np.array([s.prompt_tokens for s in samples], dtype=np.float64)
        h = np.array([s.hit_tokens for s in samples], dtype=np.float64)
        with np.errstate(invalid="ignore", divide="ignore"):
            ax.plot(t, np.where(p > 0, h / p, np.nan), lw=1.5, label="since the start")
        ax.axhline(result.oracle_hit_rate, color="grey", ls="--", lw=1,
                   label="oracle (one infinite cache)")
        ax.legend(loc="lower right", fontsize=8)
        ax.set_ylim(0, 1.01)
    else:
        _no_data(ax)
    _over_time(ax, "prompt tokens served from cache", "cluster prefix hit rate")
    return _save(plt, fig, path)


def plots(result: SimResult, out_dir: str | Path) -> list[Path]:
    """Write the PNGs under ``out_dir`` and return their paths: ``ttft_cdf``, ``itl_cdf``,
    ``worker_load``, ``kv_use``, ``prefill_queue``, ``hit_rate``."""
    plt = pyplot()
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    done = [r for r in result.records if r.completed]
    ttft = np.array([r.ttft_s * 1000.0 for r in done], dtype=np.float64)
    gaps_ms = np.asarray(result.gaps.values, dtype=np.float64) * 1000.0
    samples = result.worker_samples
    return [
        _cdf(plt, ttft, np.ones(len(ttft), dtype=np.int64), "TTFT (ms)",
             "time to first token", d / "ttft_cdf.png"),
        _cdf(plt, gaps_ms, np.asarray(result.gaps.counts, dtype=np.int64), "ITL (ms)",
             "inter-token latency", d / "itl_cdf.png"),
        _per_worker(plt, samples, "load", "requests running + waiting",
                    "requests on each decode worker", d / "worker_load.png"),
        _per_worker(plt, samples, "kv_use", "KV blocks used / total",
                    "KV cache use on each decode worker", d / "kv_use.png"),
        _queue(plt, samples, d / "prefill_queue.png"),
        _hit_rate(plt, result, d / "hit_rate.png"),
    ]
