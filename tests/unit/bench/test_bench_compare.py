"""`bench compare`: run specs, presets and the ratio table."""

from __future__ import annotations

import argparse

import pytest

from services.bench.compare import RunSpec, _specs, ratio_table
from services.bench.presets import PRESETS
from services.bench.serve import slim
from services.cli import build_parser


def test_run_spec_parse() -> None:
    s = RunSpec.parse("rr=configs/scale-mock.yaml@router.mode=round_robin,decode.replicas=64")
    assert s == RunSpec("rr", "configs/scale-mock.yaml",
                        ("router.mode=round_robin", "decode.replicas=64"))
    assert RunSpec.parse("kv=a.yaml") == RunSpec("kv", "a.yaml", ())
    for bad in ("kv", "=a.yaml", "kv=", "kv=a.yaml@router.mode"):
        with pytest.raises(ValueError, match="--run"):
            RunSpec.parse(bad)


def _summary(ttft: float, hit: float) -> dict:
    d = {"mean": ttft, "p50": ttft, "p90": ttft, "p99": 2 * ttft, "count": 1}
    return {"summary": {"ttft": d, "itl": d, "tpot": d, "output_throughput": 10.0,
                        "goodput": None, "prefix_hit_rate": hit}}


def test_ratio_table_divides_baseline_by_run_for_latencies() -> None:
    table = ratio_table({"rr": _summary(300.0, 0.2), "kv": _summary(100.0, 0.6)})
    rows = {line[:18].strip(): line for line in table.splitlines()}
    assert "( 3.00x)" in rows["mean TTFT ms"]  # 300 / 100: kv is 3x lower
    assert "( 3.00x)" in rows["prefix hit rate"]  # 0.6 / 0.2: 3x higher
    assert "( 1.00x)" in rows["out tok/s"]
    assert rows["goodput req/s"].count("n/a") == 2


def _compare_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", "compare", *argv])


def test_preset_sets_workload_and_runs_and_later_options_override() -> None:
    a = _compare_args("--preset", "real-routing-pressure", "--num-requests", "160",
                      "--slo", "e2e_ms=9000", "--set-all", "frontend.port=8300")
    assert (a.workload, a.groups, a.system_len, a.num_requests) == ("shared-prefix", 8, 512, 160)
    assert a.slo == ["ttft_ms=2000", "e2e_ms=9000"]
    specs = _specs(a)
    assert [s.name for s in specs] == ["round_robin", "kv", "ttft"]
    assert specs[1].overrides == ("router.mode=kv", "engine.num_kv_blocks=160", "frontend.port=8300")
    # the preset's own list is not changed by a parse that appended to it
    assert PRESETS["real-routing-pressure"].options["slo"] == ["ttft_ms=2000"]


def test_explicit_runs_replace_the_presets() -> None:
    a = _compare_args("--preset", "mock-shared", "--run", "w8=x.yaml@router.overlap_weight=8")
    assert [s.name for s in _specs(a)] == ["w8"]


def test_an_option_before_the_preset_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _compare_args("--rate", "3", "--preset", "mock-shared")
    assert "put --preset first" in capsys.readouterr().err


def test_specs_are_checked_before_any_cluster_starts() -> None:
    with pytest.raises(ValueError, match="--run"):
        _specs(_compare_args())
    with pytest.raises(ValueError, match="needs --trace"):
        _specs(_compare_args("--preset", "mock-mooncake"))
    with pytest.raises(ValueError, match="--set-all"):
        _specs(_compare_args("--run", "a=x.yaml", "--set-all", "oops"))


def test_slim_keeps_the_summary_not_the_samples() -> None:
    full = {"meta": {}, "summary": {}, "oracle_prefix_hit_rate": 0.5, "requests": [{}],
            "itl_ms": [1.0]}
    assert slim(full) == {"meta": {}, "summary": {}, "oracle_prefix_hit_rate": 0.5}
