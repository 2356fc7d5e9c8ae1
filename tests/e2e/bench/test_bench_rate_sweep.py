"""`tandem bench compare --rates` end to end: `tandem up` of an aggregated and a
disaggregated layout on the mock runner, each started once and driven at two rates; the
result files' shape, and goodput as the highest rate that meets the attainment target."""

from __future__ import annotations

import json
import os
from pathlib import Path

from services.cli import main as tandem
from tests.support.ports import free_port


def test_rate_sweep_of_two_layouts(smollm2_path: Path, tmp_path: Path) -> None:
    had_token = "TANDEM_CLUSTER_TOKEN" in os.environ
    # NOTE: ports clear of any cluster someone else may be running; one replica per kind
    ports = (f"nats.url=nats://127.0.0.1:{free_port()},frontend.port={free_port()},"
             f"processor.port={free_port()},processor.metrics_port={free_port()},"
             f"router.port={free_port()},router.metrics_port={free_port()},"
             f"decode.port={free_port()},decode.metrics_port={free_port()},"
             f"prefill.metrics_port={free_port()},launcher.metrics_port={free_port()},"
             "engine.runner=mock,namespace=sweeptest")
    full, summary = tmp_path / "full.json", tmp_path / "summary.json"
    rc = tandem(["bench", "compare",
                 "--run", f"agg=configs/agg.yaml@decode.replicas=1,{ports}",
                 "--run", f"disagg=configs/disagg.yaml@decode.replicas=1,prefill.replicas=1,{ports}",
                 "--workload", "mixed", "--short-len", "16", "--long-len", "320",
                 "--long-fraction", "0.5", "--output-len", "4", "--num-requests", "4",
                 "--rates", "8,4", "--rate-settle", "0.2", "--settle", "1",
                 # loose enough that every request meets both: goodput is the highest rate
                 "--slo", "ttft_ms=60000", "--slo", "tpot_ms=10000",
                 "--json", str(full), "--summary-json", str(summary),
                 "--plot", str(tmp_path / "plots"), "--log-dir", str(tmp_path / "logs")])
    assert rc == 0
    assert ("TANDEM_CLUSTER_TOKEN" in os.environ) == had_token
    res = json.loads(full.read_text())
    sweep = res["sweep"]
    assert sweep["rates"] == [4.0, 8.0] and sweep["attainment_target"] == 0.9
    assert sweep["slos"] == {"ttft_ms": 60000.0, "tpot_ms": 10000.0}
    assert list(sweep["layouts"]) == ["agg", "disagg"]
    for name, layout in sweep["layouts"].items():
        points = layout["points"]
        assert [p["rate"] for p in points] == [4.0, 8.0]
        assert all(p["requests"] == 4 and p["failed"] == 0 and p["met_slos"] == 4
                   and p["attainment"] == 1.0 for p in points)
        assert all(0 < p["ttft_p50_ms"] <= p["ttft_p99_ms"] and p["itl_p99_ms"] > 0
                   for p in points)
        passing = [p["rate"] for p in points if p["attainment"] >= 0.9]
        assert layout["goodput_rps"] == max(passing) == 8.0
        # one result per rate, in order, each with its rows; the second with shifted ids
        runs = res["rate_runs"][name]
        assert [r["meta"]["args"]["rate"] for r in runs] == [4.0, 8.0]
        assert [r["meta"]["token_id_shift"] for r in runs] == [0, 1]
        assert all(r["meta"]["run"]["name"] == name and len(r["requests"]) == 4 for r in runs)
    [c] = sweep["comparisons"]
    assert (c["baseline"], c["run"], c["goodput_ratio"], c["sustained_rate"]) == (
        "agg", "disagg", 1.0, 8.0)
    assert c["ttft_p99_ratio"] > 0 and c["itl_p99_ratio"] > 0
    slim = json.loads(summary.read_text())
    assert slim["sweep"] == sweep
    assert all("requests" not in r for rs in slim["rate_runs"].values() for r in rs)
    assert [p.name for p in (tmp_path / "plots").iterdir()] == ["slo_attainment.png"]
