"""`bench compare`: run specs and the ratio table."""

from __future__ import annotations

import pytest

from services.bench.compare import RunSpec, ratio_table


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
