"""`tandem up` with ``planner.enabled`` on the mock runner: the launcher starts
`tandem planner` as a part of the cluster and serves its control endpoint; a policy that
asks for one more decode worker (TANDEM_PLANNER_POLICY, tests/support/planner_fakes.py)
makes the launcher start decode-1 in its reserved slot, which logs in to NATS with the user
made for it, registers in discovery and serves requests; the planner's metrics say so. Then
a scale-down by hand through the control endpoint (the cluster token required): decode-1
drains and exits 0, nothing restarts it, and the planner adopts the hand change instead of
scaling back up."""

from __future__ import annotations

import concurrent.futures
import time
import uuid
from pathlib import Path

import httpx
import pytest

from services.common.config import ClusterConfig
from tests.support.mock_cluster import MODEL, mock_cluster_cfg
from tests.support.ports import free_port, free_port_pair
from tests.support.procs import needs_nats_server, write_config
from tests.support.up import gone, metric, start_up


def _cfg() -> ClusterConfig:
    return mock_cluster_cfg(
        namespace=f"plan{uuid.uuid4().hex[:8]}",
        nats={"url": f"nats://127.0.0.1:{free_port()}", "embedded": True},
        frontend={"port": free_port()},
        processor={"port": free_port(), "metrics_port": free_port()},
        router={"port": free_port(), "metrics_port": free_port()},
        decode={"replicas": 1, "port": free_port_pair(), "metrics_port": free_port_pair(),
                "grace_period_s": 1},
        prefill={"replicas": 0, "metrics_port": free_port()},
        launcher={"metrics_port": free_port()},
        planner={"enabled": True, "interval_s": 1.0, "cooldown_s": 0, "min_prefill": 0,
                 "max_prefill": 0, "max_decode": 2, "max_total_workers": 2,
                 "metrics_port": free_port(), "control_port": free_port()},
    )


def _decode_prompts(cfg: ClusterConfig, replica: int) -> float:
    url = f"http://127.0.0.1:{cfg.decode.metrics_port + replica}/metrics"
    return metric(url, "tandem_worker_prompt_tokens_total")


def test_the_planner_asks_for_a_decode_worker_and_it_joins_and_serves(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    needs_nats_server()
    monkeypatch.setenv("TANDEM_PLANNER_POLICY", "tests.support.planner_fakes:one_more_decode")
    monkeypatch.setenv("TANDEM_CLUSTER_TOKEN", "planner-test-token")  # the launcher's, not a fresh one
    cfg = _cfg()
    up = start_up(write_config(cfg, tmp_path / "cluster.yaml"), tmp_path / "run", ["--ready-timeout", "180"])
    try:
        up.wait_for(r"^tandem is ready in", timeout=200)
        assert "planner" in up.pids()
        up.wait_for(r"^starting decode-1 \(pid \d+\)$", timeout=60)
        up.wait_for(r"^ready    decode-1 ", timeout=120)
        planner_metrics = f"http://127.0.0.1:{cfg.planner.metrics_port}/metrics"
        deadline = time.monotonic() + 30
        while metric(planner_metrics, 'tandem_planner_actual_replicas{role="decode"}') != 2:
            assert time.monotonic() < deadline, httpx.get(planner_metrics).text
            time.sleep(0.5)
        assert metric(planner_metrics,
                      'tandem_planner_decisions_total{action="scale_up",reason="one_more"}') == 1
        url = f"http://127.0.0.1:{cfg.frontend.port}/v1/chat/completions"

        def chat(i: int) -> int:
            body = {"model": MODEL, "max_tokens": 16,
                    "messages": [{"role": "user", "content": f"{uuid.uuid4().hex} question {i}"}]}
            return httpx.post(url, json=body, timeout=60).status_code

        # decode-1 serves: concurrent requests spread over both workers by load
        deadline = time.monotonic() + 60
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            while _decode_prompts(cfg, 1) == 0:
                assert time.monotonic() < deadline, "decode-1 never served a request"
                assert set(pool.map(chat, range(16))) == {200}
        assert "\nrestart  " not in up.output()  # no part died
        # the planner reads the traffic, logged in as its NATS user with its permissions
        deadline = time.monotonic() + 30
        while metric(planner_metrics, "tandem_planner_arrival_rate") == 0:
            assert time.monotonic() < deadline, httpx.get(planner_metrics).text
            assert chat(0) == 200
        assert "round failed" not in (up.run_dir / "logs" / "planner.log").read_text()

        control = f"http://127.0.0.1:{cfg.planner.control_port}/split"
        assert httpx.post(control, json={"prefill": 0, "decode": 1}).status_code == 401
        r = httpx.post(control, json={"prefill": 0, "decode": 1},
                       headers={"Authorization": "Bearer planner-test-token"})
        assert (r.status_code, r.json()) == (202, {"prefill": 0, "decode": 1})
        up.wait_for(r"^draining decode-1 \(pid \d+\)$", timeout=30)
        up.wait_for(r"^drained  decode-1 \(exited with code 0\)$", timeout=60)
        assert "decode-1" not in up.pids()
        deadline = time.monotonic() + 30
        while metric(planner_metrics, "tandem_planner_adopted_changes_total") < 1:
            assert time.monotonic() < deadline, httpx.get(planner_metrics).text
            time.sleep(0.5)
        assert metric(planner_metrics, 'tandem_planner_actual_replicas{role="decode"}') == 1
        assert up.output().count("starting decode-1") == 1  # neither restarted nor re-added
        assert chat(0) == 200
    finally:
        code = up.stop()
    out = up.output()
    assert code == 0, out
    assert "stopped  planner" in out
    assert all(gone(pid) for pid in up.pids().values())
