"""`--sweep`: the cross product of the swept values, and each point run in a process of
its own, coming back in point order."""

from __future__ import annotations

import io
import os
import time
from typing import Any

import pytest

from services.sim.sweep import parse_sweep, point_overrides, run_sweep, sweep_row


def test_the_cross_product_in_order_first_key_slowest() -> None:
    assert parse_sweep(["decode.replicas=8,64", "router.mode= kv , random,round_robin"]) == [
        {"decode.replicas": "8", "router.mode": "kv"},
        {"decode.replicas": "8", "router.mode": "random"},
        {"decode.replicas": "8", "router.mode": "round_robin"},
        {"decode.replicas": "64", "router.mode": "kv"},
        {"decode.replicas": "64", "router.mode": "random"},
        {"decode.replicas": "64", "router.mode": "round_robin"},
    ]
    assert parse_sweep(["a=1"]) == [{"a": "1"}]
    assert parse_sweep([]) == [{}]


@pytest.mark.parametrize(("items", "match"), [
    (["decode.replicas"], "expected KEY=V1,V2"),
    (["=1,2"], "expected KEY=V1,V2"),
    (["a=1,,2"], "an empty value"),
    (["a="], "an empty value"),
    (["a=1,2,1"], "a value repeated"),
    (["a=1", "b=2", "a=3"], "a is swept twice"),
])
def test_bad_items_are_named(items: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=match) as e:
        parse_sweep(items)
    assert repr(items[-1]) in str(e.value)


def test_a_point_overrides_the_runs_own_settings() -> None:
    assert point_overrides(["a=1", "b=2"], {"a": "3"}) == ["a=1", "b=2", "a=3"]


def _summary(overrides: list[str]) -> dict[str, Any]:
    """A stand-in for the integrator's run_one: which process ran which overrides. The
    first point sleeps so that, run in parallel, it ends last."""
    if overrides[-1] == "x=0":
        time.sleep(1.0)
    return {"pid": os.getpid(), "overrides": overrides,
            "ttft_ms": {"mean": 1.5, "p50": 1.0, "p90": 2.25, "p99": 3.0},
            "itl_ms": {"mean": 0.5, "p50": 0.5, "p90": 0.5, "p99": 0.5},
            "prefix_hit_rate": 0.25, "goodput_rps": 4.0, "remote_prefill_fraction": 0.0,
            "wall_s": 0.125}


def test_points_run_in_child_processes_and_come_back_in_order() -> None:
    points = parse_sweep(["x=0,1,2"])
    out = io.StringIO()
    got = list(run_sweep(["base=1"], points, _summary, processes=2, out=out))
    assert [p for p, _ in got] == points
    assert [s["overrides"] for _, s in got] == [["base=1", "x=0"], ["base=1", "x=1"],
                                                ["base=1", "x=2"]]
    pids = [s["pid"] for _, s in got]
    assert os.getpid() not in pids
    assert len(set(pids)) == 3  # a fresh process per point
    lines = out.getvalue().splitlines()
    assert lines[0].split() == ["x", "ttft_mean_ms", "ttft_p90_ms", "itl_mean_ms", "hit_rate",
                                "goodput_rps", "remote_frac", "wall_s"]
    assert [line.split() for line in lines[1:]] == [
        [x, "1.500", "2.250", "0.500", "0.250", "4.000", "0.000", "0.125"] for x in "012"]


def test_no_points_run_nothing() -> None:
    assert list(run_sweep([], [], _summary)) == []


def test_a_row_is_the_point_then_the_figures() -> None:
    row = sweep_row({"a": "1"}, _summary(["a=1"]))
    assert list(row) == ["a", "ttft_mean_ms", "ttft_p90_ms", "itl_mean_ms", "hit_rate",
                         "goodput_rps", "remote_frac", "wall_s"]
    assert row["a"] == "1" and row["ttft_p90_ms"] == 2.25
