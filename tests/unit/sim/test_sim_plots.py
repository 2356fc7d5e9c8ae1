"""The simulator's PNGs, from SimResults built by hand: written and non-empty for a few
workers, for 64 (the band and a few lines), and with no samples at all."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from services.sim.plots import plots, windowed_hit_rate, worker_matrix
from services.sim.records import GapSamples, HitSample
from tests.support.sim_results import record, result, worker_samples

NAMES = ["ttft_cdf.png", "itl_cdf.png", "worker_load.png", "kv_use.png", "prefill_queue.png",
         "hit_rate.png"]


@pytest.mark.parametrize("workers", [2, 64])
def test_every_plot_is_written(tmp_path: Path, workers: int) -> None:
    rng = np.random.default_rng(0)
    gaps = GapSamples(list(rng.random(5000) * 0.05), [int(c) for c in rng.integers(1, 9, 5000)])
    res = result([record(i, sent=i * 0.1, ttft=0.05 + i * 0.01) for i in range(100)],
                 gaps=gaps, workers=workers, ticks=60)
    paths = plots(res, tmp_path / "plots")
    assert [p.name for p in paths] == NAMES
    for p in paths:
        assert p.parent == tmp_path / "plots"
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 2000


def test_plots_of_a_run_without_samples(tmp_path: Path) -> None:
    res = result([], gaps=GapSamples(), workers=1, ticks=0, duration=0.0)
    paths = plots(res, tmp_path)
    assert [p.name for p in paths] == NAMES
    assert all(p.stat().st_size > 0 for p in paths)


def test_worker_matrix_is_time_by_worker() -> None:
    samples = worker_samples(3, 4)
    t, workers, load = worker_matrix(samples, "load")
    assert list(t) == [0.0, 0.25, 0.5, 0.75]
    assert workers == ["decode-0", "decode-1", "decode-2"]
    s = samples[2 * 3 + 1]  # tick 2, decode-1
    assert load[2, 1] == s.running + s.waiting
    _, _, kv = worker_matrix(samples, "kv_use")
    assert kv[2, 1] == s.kv_blocks_used / 64


def test_windowed_hit_rate_uses_the_tokens_admitted_in_the_window() -> None:
    samples = [HitSample(0.0, 0, 0), HitSample(1.0, 100, 10), HitSample(2.0, 300, 110),
               HitSample(3.0, 300, 110)]
    t, rate = windowed_hit_rate(samples, 1.0)
    assert list(t) == [0.0, 1.0, 2.0, 3.0]
    assert np.isnan(rate[0]) and np.isnan(rate[3])  # nothing admitted in the window
    assert rate[1] == 0.1 and rate[2] == 0.5
