"""`tandem processor` and `tandem frontend` as processes: they find each other through
discovery on a real nats-server, answer, and exit 0 on SIGTERM after deregistering."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from services.common.config import parse_config
from services.launcher.nats import tcp_accepts
from tests.support.ports import free_port
from tests.support.procs import start_part, stop_parts, wait_http_ok, write_config


def test_processor_and_frontend_processes(nats_url: str, smollm2_path: Path, tmp_path: Path) -> None:
    fe_port = free_port()
    cfg = parse_config({}, [f"nats.url={nats_url}", "namespace=procs", f"processor.port={free_port()}",
                            f"processor.metrics_port={free_port()}", f"frontend.port={fe_port}",
                            "discovery.ttl_s=2", "discovery.heartbeat_s=0.5"])
    cfg_file = write_config(cfg, tmp_path / "cluster.yaml")
    parts = [start_part(part, cfg_file, tmp_path) for part in ("processor", "frontend")]
    try:
        url = f"http://127.0.0.1:{fe_port}"
        models = wait_http_ok(url + "/v1/models", parts).json()  # the frontend reached the processor
        assert models["data"][0]["context_length"] == 8192  # read from the GGUF, no weights loaded
        health = httpx.get(url + "/health")
        assert health.status_code == 503 and "router" in health.json()["detail"]
        r = httpx.post(url + "/v1/chat/completions", json={
            "model": models["data"][0]["id"], "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503 and "retry-after" in r.headers
    finally:
        codes = stop_parts(parts)
    assert codes == {"processor-0": 0, "frontend-0": 0}, codes


@pytest.mark.parametrize("part", ["router", "processor"])
def test_sigterm_the_moment_the_port_accepts_exits_0(
        part: str, nats_url: str, smollm2_path: Path, tmp_path: Path) -> None:
    """What `tandem up` does to a part that is ready and then stopped at once: the signal
    comes while the part is still registering, and must not kill it by the default action."""
    port = free_port()
    cfg = parse_config({}, [f"nats.url={nats_url}", f"namespace=early-{part}", f"{part}.port={port}",
                            f"{part}.metrics_port={free_port()}"])
    proc = start_part(part, write_config(cfg, tmp_path / "cluster.yaml"), tmp_path)
    try:
        while not tcp_accepts("127.0.0.1", port, timeout=0.2):
            proc.assert_alive()
            time.sleep(0.002)  # poll tightly: the signal should land inside startup
        code = proc.stop(timeout=60)
    finally:
        proc.kill9()
    assert code == 0, proc.output()
    assert {"router": "serving gRPC", "processor": "gRPC on"}[part] in proc.output()  # it did start
