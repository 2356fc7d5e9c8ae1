"""`tandem sim calibrate --quick` end to end on one workload: `tandem up` of 8 mock decode
workers, the overhead probes, the chat workload, the simulator; every figure in the JSON."""

from __future__ import annotations

import json
import os
from pathlib import Path

from services.cli import main as tandem
from tests.support.ports import free_port, free_run


def test_calibrate_quick_chat_writes_every_figure(smollm2_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "calib.json"
    had_token = "TANDEM_CLUSTER_TOKEN" in os.environ
    # NOTE: ports clear of a scale-mock cluster someone else may be running
    ports = [f"nats.url=nats://127.0.0.1:{free_port()}", f"frontend.port={free_port()}",
             f"processor.port={free_port()}", f"processor.metrics_port={free_port()}",
             f"router.port={free_port()}", f"router.metrics_port={free_port()}",
             f"decode.port={free_run(8)}", f"decode.metrics_port={free_run(8)}",
             f"launcher.metrics_port={free_port()}", "namespace=calibtest"]
    rc = tandem(["sim", "calibrate", "--workload", "chat", "--quick", "--num-requests", "24",
                 "--probes", "5", "--json", str(out), "--log-dir", str(tmp_path / "logs"),
                 *(a for o in ports for a in ("--set", o))])
    assert rc == 0
    # the cluster's token does not outlive it in this process (the tests after it serve
    # gRPC without one)
    assert ("TANDEM_CLUSTER_TOKEN" in os.environ) == had_token
    res = json.loads(out.read_text())
    chat = res["workloads"]["chat"]
    assert chat["requests"] == 24
    assert chat["real"]["completed"] == chat["sim"]["completed"] == 24
    ov = chat["overheads"]
    assert 0 < ov["request_s"] < 1.0 and len(ov["probe_ttft_s"]) == 5
    assert ov["remote_s"] is None and ov["remote_probe_ttft_s"] == []  # no prefill workers
    figures = [r["figure"] for r in res["rows"]]
    assert figures == ["ttft_mean_ms", "ttft_p90_ms", "itl_mean_ms", "prefix_hit_rate",
                       "tpot_mean_ms", "e2e_mean_ms"]
    for r in res["rows"]:
        assert r["workload"] == "chat" and r["real"] > 0 and r["sim"] > 0
        assert r["error_pct"] is not None
    assert len(chat["per_request"]) == 24
    assert all(p["real_error"] is None and p["sim_error"] is None for p in chat["per_request"])
