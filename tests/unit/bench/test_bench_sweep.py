"""Rate sweeps: SLO attainment, DistServe goodput and the comparison, from hand-made rows."""

from __future__ import annotations

import json

import pytest

from services.bench.sweep import (
    LayoutSweep,
    RatePoint,
    SweepComparison,
    check_sweep,
    comparison_table,
    goodput_rate,
    layout_table,
    parse_rates,
    slo_attainment,
    sustained_by_both,
    sweep_json,
)
from services.bench.workloads import ID_HIGH, ID_LOW, BenchRequest, shifted_ids

SLOS = {"ttft_ms": 3000.0, "tpot_ms": 100.0}


def row(ttft: float, tpot: float | None, ok: bool = True, max_itl: float | None = None) -> dict:
    if not ok:
        return {"ok": False, "error": "HTTP 503"}
    return {"ok": True, "ttft_ms": ttft, "tpot_ms": tpot, "e2e_ms": ttft + 10 * (tpot or 0),
            "max_itl_ms": max_itl}


def test_attainment_needs_both_targets_and_counts_failures_as_misses() -> None:
    rows = [row(100, 50),          # meets both
            row(3500, 50),         # TTFT over
            row(100, 150),         # TPOT over
            row(3000, 100),        # exactly at both targets: met
            row(200, None),        # one token: no TPOT, TTFT met
            row(0, 0, ok=False)]   # failed: a miss
    assert slo_attainment(rows, SLOS) == (3, 6)
    # an ITL target, when given, applies to the largest gap
    assert slo_attainment([row(100, 50, max_itl=400)], {**SLOS, "itl_ms": 300}) == (0, 1)
    assert slo_attainment([], SLOS) == (0, 0)


def point(rate: float, attainment: float, ttft_p99: float = 1000.0, itl_p99: float = 50.0) -> RatePoint:
    return RatePoint(rate, 100, 0, round(attainment * 100), attainment, ttft_p99 / 2, ttft_p99,
                     itl_p99, rate, 30 * rate)


def test_goodput_is_the_highest_rate_meeting_the_target() -> None:
    pts = [point(0.25, 1.0), point(0.5, 0.95), point(1.0, 0.89), point(2.0, 0.1)]
    assert goodput_rate(pts, 0.9) == 0.5
    assert goodput_rate(pts, 0.8) == 1.0
    assert goodput_rate(pts, 0.96) == 0.25
    assert goodput_rate([point(0.5, 0.5)], 0.9) == 0.0
    assert goodput_rate([], 0.9) == 0.0
    # a noisy dip at a lower rate does not cap it (the highest passing rate counts)
    assert goodput_rate([point(0.5, 0.85), point(1.0, 0.92)], 0.9) == 1.0
    assert goodput_rate([point(1.0, 0.9)], 0.9) == 1.0  # >= the target


def test_rate_point_of_a_result() -> None:
    d = {"mean": 0.0, "p50": 120.0, "p90": 0.0, "p99": 900.0, "count": 3}
    result = {"summary": {"failed": 1, "ttft": d, "itl": {**d, "p99": 80.0},
                          "request_throughput": 0.4, "output_throughput": 12.0},
              "requests": [row(100, 50), row(100, 150), row(5000, 50), row(0, 0, ok=False)]}
    p = RatePoint.of(0.5, result, SLOS)
    assert (p.rate, p.requests, p.failed, p.met_slos) == (0.5, 4, 1, 1)
    assert p.attainment == pytest.approx(0.25)
    assert (p.ttft_p50_ms, p.ttft_p99_ms, p.itl_p99_ms) == (120.0, 900.0, 80.0)
    assert (p.request_throughput, p.output_throughput) == (0.4, 12.0)


def _sweeps() -> tuple[LayoutSweep, LayoutSweep]:
    agg = LayoutSweep.of("agg", [point(1.0, 0.5, 4000, 900), point(0.25, 1.0, 900, 300),
                                 point(0.5, 0.92, 1500, 600)], 0.9)
    disagg = LayoutSweep.of("disagg", [point(0.25, 1.0, 800, 40), point(0.5, 0.97, 1200, 60),
                                       point(1.0, 0.93, 2000, 90)], 0.9)
    return agg, disagg


def test_layouts_compare_at_the_highest_rate_both_sustain() -> None:
    agg, disagg = _sweeps()
    assert [p.rate for p in agg.points] == [0.25, 0.5, 1.0]  # sorted by rate
    assert (agg.goodput_rps, disagg.goodput_rps) == (0.5, 1.0)
    assert sustained_by_both(agg, disagg, 0.9) == 0.5
    c = SweepComparison.of(agg, disagg, 0.9)
    assert (c.baseline, c.run, c.sustained_rate) == ("agg", "disagg", 0.5)
    assert c.goodput_ratio == pytest.approx(2.0)
    assert c.ttft_p99_ratio == pytest.approx(1500 / 1200)  # agg / disagg: > 1, disagg better
    assert c.itl_p99_ratio == pytest.approx(10.0)


def test_no_rate_sustained_leaves_ratios_unset() -> None:
    agg = LayoutSweep.of("agg", [point(0.5, 0.5)], 0.9)
    disagg = LayoutSweep.of("disagg", [point(0.5, 0.95)], 0.9)
    c = SweepComparison.of(agg, disagg, 0.9)
    assert agg.goodput_rps == 0.0 and c.goodput_ratio is None  # nothing to divide by
    assert (c.sustained_rate, c.ttft_p99_ratio, c.itl_p99_ratio) == (None, None, None)
    assert SweepComparison.of(disagg, agg, 0.9).goodput_ratio == 0.0
    assert "no rate sustained by both" in comparison_table([agg, disagg], 0.9)


def test_tables_show_every_rate_the_misses_and_the_ratios() -> None:
    agg, disagg = _sweeps()
    t = layout_table(agg, 0.9).splitlines()
    assert t[0] == "agg: SLO attainment by rate"
    assert len(t) == 2 + 3 + 1
    assert "92.0% " in t[3] and "50.0%*" in t[4]  # * marks a rate below the target
    assert t[-1].startswith("goodput 0.5 req/s")
    s = comparison_table([agg, disagg], 0.9)
    assert "disagg vs agg: goodput 2.00x" in s
    assert "at 0.5 req/s" in s and "TTFT p99 1.25x" in s and "ITL p99 10.00x" in s


def test_sweep_json_has_points_goodputs_and_comparisons() -> None:
    agg, disagg = _sweeps()
    j = json.loads(json.dumps(sweep_json([agg, disagg], [0.25, 0.5, 1.0], 0.9, SLOS)))
    assert j["rates"] == [0.25, 0.5, 1.0] and j["attainment_target"] == 0.9 and j["slos"] == SLOS
    assert j["layouts"]["disagg"]["goodput_rps"] == 1.0
    assert [p["rate"] for p in j["layouts"]["agg"]["points"]] == [0.25, 0.5, 1.0]
    assert j["comparisons"] == [{"baseline": "agg", "run": "disagg", "goodput_ratio": 2.0,
                                 "sustained_rate": 0.5, "ttft_p99_ratio": 1.25,
                                 "itl_p99_ratio": 10.0}]


def test_parse_rates_and_check_sweep() -> None:
    assert parse_rates("1, 0.25,0.5") == (0.25, 0.5, 1.0)
    for bad, msg in (("0.5,x", "not a number"), ("0.5,0", "> 0"), ("1,1.0", "twice")):
        with pytest.raises(ValueError, match=msg):
            parse_rates(bad)
    check_sweep(SLOS, 0.9, "poisson")
    with pytest.raises(ValueError, match="tpot_ms"):
        check_sweep({"ttft_ms": 1.0}, 0.9, "poisson")
    with pytest.raises(ValueError, match="--attainment"):
        check_sweep(SLOS, 1.5, "poisson")
    with pytest.raises(ValueError, match="--arrival"):
        check_sweep(SLOS, 0.9, "concurrency")


def test_shifted_ids_keep_the_sharing_within_and_nothing_across() -> None:
    a = BenchRequest(0, (ID_LOW, 5000, ID_HIGH - 1), 4, 1.5, None)
    b = BenchRequest(1, (ID_LOW, 5000, 7000), 4, None, 0)
    sa, sb = shifted_ids([a, b], 2)
    assert sa.prompt_ids == (ID_LOW + 2, 5002, ID_LOW + 1)  # wraps inside the id range
    assert sb.prompt_ids[:2] == sa.prompt_ids[:2]  # a shared prefix stays shared
    assert (sb.index, sb.output_len, sa.arrival_s, sb.after) == (1, 4, 1.5, 0)
    assert shifted_ids([a], 0) == [a]


def test_report_renders_a_sweep_file_as_markdown() -> None:
    from services.bench.report import sweep_rows

    agg, disagg = _sweeps()
    rows = sweep_rows(json.loads(json.dumps(sweep_json([agg, disagg], [0.25, 0.5, 1.0], 0.9,
                                                       SLOS))))
    assert rows[2] == "| agg | 0.25 | 100% | 450 | 900 | 300 | 0.25 | 0.5 |"
    assert len(rows) == 2 + 6 + 1
    assert rows[-1] == ("\ndisagg vs agg: goodput 2.00x; at 0.5 req/s TTFT p99 1.25x, "
                        "ITL p99 10.00x (agg / disagg)")
