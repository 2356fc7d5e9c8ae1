"""`tandem processor` and `tandem frontend` as processes: they find each other through
discovery on a real nats-server, answer, and exit 0 on SIGTERM after deregistering."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from services.common.config import parse_config
from services.launcher.nats import tcp_accepts
from tests.support.cluster import free_port
from tests.support.procs import start_part, write_config


def test_processor_and_frontend_processes(nats_url: str, smollm2_path: Path, tmp_path: Path) -> None:
    fe_port = free_port()
    sets = [f"nats.url={nats_url}", "namespace=procs", f"processor.port={free_port()}",
            f"processor.metrics_port={free_port()}", f"frontend.port={fe_port}",
            "discovery.ttl_s=2", "discovery.heartbeat_s=0.5"]
    args = [a for s in sets for a in ("--set", s)]
    procs = {}
    for part in ("processor", "frontend"):
        log = (tmp_path / f"{part}.log").open("w")
        procs[part] = subprocess.Popen([sys.executable, "-m", "services.cli", part, *args],
                                       stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{fe_port}"
        models = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for name, p in procs.items():
                assert p.poll() is None, f"{name} died: {(tmp_path / f'{name}.log').read_text()[-2000:]}"
            try:
                r = httpx.get(url + "/v1/models", timeout=2)
                if r.status_code == 200:
                    models = r.json()
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        assert models is not None, "the frontend never reached the processor"
        assert models["data"][0]["context_length"] == 8192  # read from the GGUF, no weights loaded
        health = httpx.get(url + "/health")
        assert health.status_code == 503 and "router" in health.json()["detail"]
        r = httpx.post(url + "/v1/chat/completions", json={
            "model": models["data"][0]["id"], "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503 and "retry-after" in r.headers
    finally:
        for p in procs.values():
            p.send_signal(signal.SIGTERM)
        codes = {name: p.wait(timeout=30) for name, p in procs.items()}
    assert codes == {"processor": 0, "frontend": 0}, codes


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
            assert proc.alive(), proc.output()
            time.sleep(0.002)  # poll tightly: the signal should land inside startup
        proc.proc.send_signal(signal.SIGTERM)
        code = proc.proc.wait(timeout=60)
    finally:
        proc.kill9()
    assert code == 0, proc.output()
    assert {"router": "serving gRPC", "processor": "gRPC on"}[part] in proc.output()  # it did start
