"""`tandem sim --sweep key=v1,v2,...`: the cross product of the swept values, each point a
simulation in a process of its own, one table row per point as it comes back.

A point is a dict of ``--set`` overrides (``{"decode.replicas": "8", "router.mode":
"kv"}``); it is applied after the run's own ``--set`` items, so a swept key wins.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TextIO

from services.sim.report import cell, format_row

Point = dict[str, str]
Summary = dict[str, Any]
# What a sweep's row shows of a summary: column -> (summary key, its field or None).
_COLUMNS: dict[str, tuple[str, str | None]] = {
    "ttft_mean_ms": ("ttft_ms", "mean"),
    "ttft_p90_ms": ("ttft_ms", "p90"),
    "itl_mean_ms": ("itl_ms", "mean"),
    "hit_rate": ("prefix_hit_rate", None),
    "goodput_rps": ("goodput_rps", None),
    "remote_frac": ("remote_prefill_fraction", None),
    "wall_s": ("wall_s", None),
}
_NUMBER_WIDTH = 10


def parse_sweep(items: Sequence[str]) -> list[Point]:
    """``["a=1,2", "b=x,y"]`` -> ``[{a:1,b:x}, {a:1,b:y}, {a:2,b:x}, {a:2,b:y}]``: the cross
    product, the first key varying slowest (no items: one empty point). ValueError naming
    the item for a missing ``=``, an empty key or value, a key swept twice or a value
    repeated."""
    axes: list[tuple[str, list[str]]] = []
    for item in items:
        key, sep, rest = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"--sweep {item!r}: expected KEY=V1,V2,...")
        if any(key == k for k, _ in axes):
            raise ValueError(f"--sweep {item!r}: {key} is swept twice; give its values in one item")
        values = [v.strip() for v in rest.split(",")]
        if not all(values):
            raise ValueError(f"--sweep {item!r}: an empty value")
        if len(set(values)) != len(values):
            raise ValueError(f"--sweep {item!r}: a value repeated")
        axes.append((key, values))
    keys = [k for k, _ in axes]
    return [dict(zip(keys, combo, strict=True))
            for combo in itertools.product(*(vs for _, vs in axes))]


def point_overrides(base_overrides: Sequence[str], point: Point) -> list[str]:
    """The ``--set`` items of one point: the run's own, then the point's (which win)."""
    return [*base_overrides, *(f"{k}={v}" for k, v in point.items())]


def sweep_row(point: Point, summary: Summary) -> dict[str, object]:
    """The swept values, then mean/p90 TTFT, mean ITL, hit rate, goodput, remote fraction
    and wall time."""
    row: dict[str, object] = dict(point)
    for column, (key, sub) in _COLUMNS.items():
        v = summary[key]
        row[column] = v[sub] if sub is not None else v
    return row


def run_sweep(base_overrides: Sequence[str], points: Sequence[Point],
              run_one: Callable[[list[str]], Summary], processes: int | None = None,
              out: TextIO | None = None) -> Iterator[tuple[Point, Summary]]:
    """Run ``run_one(point_overrides(base_overrides, point))`` for every point, each in a
    fresh process (spawned: nothing of this process's state, torch threads included, is
    inherited; a child runs one point and exits), at most ``processes`` and at most
    ``os.cpu_count()`` at once. Yields ``(point, summary)`` in point order; with ``out``,
    prints the table header first and one row per point as it is yielded.

    ``run_one`` must be picklable: a top-level function (or a ``functools.partial`` of
    one) that takes the override list and returns the summary."""
    cpus = os.cpu_count() or 1
    n = max(1, min(processes or cpus, cpus, len(points)))
    widths = _widths(points)
    if out is not None and points:
        print(format_row(list(widths), list(widths.values())), file=out, flush=True)
    if not points:
        return
    jobs = [point_overrides(base_overrides, p) for p in points]
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(n, maxtasksperchild=1) as pool:
        for point, summary in zip(points, pool.imap(run_one, jobs), strict=True):
            if out is not None:
                row = sweep_row(point, summary)
                print(format_row([cell(row[c]) for c in widths], list(widths.values())),
                      file=out, flush=True)
            yield point, summary


def _widths(points: Sequence[Point]) -> dict[str, int]:
    """Column widths known before any point ends: a swept key's from its values, a
    figure's fixed."""
    widths = {k: max(len(k), *(len(p[k]) for p in points)) for k in (points[0] if points else {})}
    widths.update({c: max(len(c), _NUMBER_WIDTH) for c in _COLUMNS})
    return widths
