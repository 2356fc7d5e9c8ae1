"""`tandem up` supervises like a process manager, with real processes: the whole cluster
(embedded nats-server, router, decode and prefill workers on the mock runner, processor,
frontend) under one launcher; kill -9 of the decode worker, then of the prefill worker.
Each comes back (ready again, registered in discovery again, doing work again), the rest
stays up the whole time (the frontend's /live never fails, no other pid changes), and the
launcher's /metrics counts the restart. Then `--fail-fast` (a death stops everything) and a
part that cannot start (a typo in model.path) making `tandem up` give up, naming it."""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from nats.js.errors import KeyNotFoundError

from services.common.config import ClusterConfig
from services.common.nats_client import Subjects, connect
from tests.support.mock_cluster import MODEL, mock_cluster_cfg
from tests.support.ports import free_port
from tests.support.procs import needs_nats_server, write_config
from tests.support.up import LivePoller, Up, gone, launcher_metric, nats_login, start_up

# Longer than decode.disagg.max_local_prefill_length (16 tokens): prefilled remotely.
LONG = "Summarise: " + "the roads, aqueducts and cities of Rome shaped later states. " * 6


@pytest.fixture(autouse=True)
def _needs_nats_server() -> None:
    needs_nats_server()


def cluster_cfg(**over: dict[str, object]) -> ClusterConfig:
    """Every part, on free ports, restarted fast; the real tokenizer (processor, frontend).
    ``over``: sections replaced whole."""
    sections: dict[str, object] = {
        "namespace": f"sup{uuid.uuid4().hex[:8]}",
        "model": {"name": MODEL, "path": "auto"},
        "nats": {"url": f"nats://127.0.0.1:{free_port()}", "embedded": True},
        "frontend": {"port": free_port()},
        "processor": {"port": free_port(), "metrics_port": free_port()},
        "router": {"port": free_port(), "metrics_port": free_port()},
        "decode": {"replicas": 1, "port": free_port(), "metrics_port": free_port(), "grace_period_s": 1,
                   "disagg": {"max_local_prefill_length": 16, "remote_prefill_timeout_s": 5}},
        "prefill": {"replicas": 1, "metrics_port": free_port(), "grace_period_s": 1},
        "launcher": {"metrics_port": free_port(), "restart_backoff_s": 0.2},
    }
    return mock_cluster_cfg(**{**sections, **over})


@dataclass
class Cluster:
    cfg: ClusterConfig
    up: Up

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.cfg.frontend.port}"

    def restarts(self, name: str) -> float:
        assert self.cfg.launcher.metrics_port is not None
        return launcher_metric(self.cfg.launcher.metrics_port, "tandem_launcher_restarts_total", name)

    def chat(self, content: str) -> httpx.Response:
        return httpx.post(self.url + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": content}]})


@pytest.fixture(scope="module")
def cluster(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("supervised")
    cfg = cluster_cfg()
    up = start_up(write_config(cfg, tmp / "cluster.yaml"), tmp / "run", ["--ready-timeout", "180"])
    try:
        up.wait_for(r"^tandem is ready in", timeout=200)
        yield Cluster(cfg, up)
    finally:
        code = up.stop()
    assert code == 0, up.output()
    assert all(gone(pid) for pid in up.pids().values())


def registered(c: Cluster, key: str) -> bool:
    """Whether ``key`` (``role.instance``) is in the discovery bucket right now (read as the
    frontend's NATS user: the cluster's NATS takes no anonymous client)."""
    cfg = c.cfg
    login = cfg.nats.model_copy(update=nats_login(c.up.run_dir))

    async def check() -> bool:
        nc = await connect(login, "test-supervision")
        try:
            kv = await nc.jetstream().key_value(Subjects(cfg.namespace).discovery_bucket)
            try:
                await kv.get(key)
            except KeyNotFoundError:
                return False
            return True
        finally:
            await nc.close()
    return asyncio.run(check())


def kill_and_watch(c: Cluster, name: str) -> None:
    """kill -9 ``name``; return once `tandem up` says it is ready again, having checked that
    /live answered throughout, no other process changed and the restart was counted."""
    before = c.up.pids()
    counted = c.restarts(name)
    attempt = int(counted) + 1
    with LivePoller(c.url + "/live") as live:
        os.kill(before[name], signal.SIGKILL)
        c.up.wait_for(rf"^restart  {name} was killed by SIGKILL after [0-9.]+ s; "
                      rf"restart {attempt} in [0-9.]+ s$", timeout=30)
        c.up.wait_for(rf"^ready    {name} +[0-9.]+ s  after restart {attempt} ", timeout=120)
    assert live.failures == [] and live.ok > 10, live.failures
    after = c.up.pids()
    assert after[name] != before[name] and not gone(after[name])
    assert {k: v for k, v in after.items() if k != name} == {k: v for k, v in before.items() if k != name}
    assert not any(gone(pid) for pid in after.values())
    assert c.restarts(name) == counted + 1
    assert "stopping the cluster" not in c.up.output()


def wait_healthy(c: Cluster, timeout: float = 60) -> None:
    """/health 200 again: a router and a decode worker are registered in discovery."""
    import time

    deadline = time.monotonic() + timeout
    while httpx.get(c.url + "/health", timeout=5).status_code != 200:
        assert time.monotonic() < deadline, httpx.get(c.url + "/health").text
        time.sleep(0.2)


def test_kill_9_decode_worker_comes_back_while_the_rest_stays_up(cluster: Cluster) -> None:
    assert cluster.chat("hello").status_code == 200
    kill_and_watch(cluster, "decode-0")
    wait_healthy(cluster)
    assert registered(cluster, "decode.decode-0")
    r = cluster.chat("hello again")
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8


def _remote_prefills(c: Cluster) -> float:
    text = httpx.get(f"http://127.0.0.1:{c.cfg.prefill.metrics_port}/metrics", timeout=5).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith('tandem_prefill_jobs_total{outcome="delivered"}'))


def test_kill_9_prefill_worker_comes_back_and_prefills_again(cluster: Cluster) -> None:
    import time

    wait_healthy(cluster)
    kill_and_watch(cluster, "prefill-0")
    # The dead worker's key expires (discovery.ttl_s); from then on only the new one keeps it.
    time.sleep(cluster.cfg.discovery.ttl_s + 1)
    assert registered(cluster, "prefill.prefill-0")
    # Its counters start at 0: jobs delivered now were run by the new process.
    deadline = time.monotonic() + 60
    while _remote_prefills(cluster) == 0:
        assert time.monotonic() < deadline, "the restarted prefill worker never ran a job"
        r = cluster.chat(LONG + uuid.uuid4().hex)  # a fresh prompt: no prefix-cache hit
        assert r.status_code == 200, r.text


def test_fail_fast_stops_the_whole_cluster_when_a_part_dies(tmp_path: Path) -> None:
    cfg = cluster_cfg()
    up = start_up(write_config(cfg, tmp_path / "cluster.yaml"), tmp_path / "run",
                  ["--only", "nats,router", "--fail-fast"])
    try:
        up.wait_for(r"^started in ", timeout=60)
        pids = up.pids()
        os.kill(pids["router"], signal.SIGKILL)
        code = up.wait(60)
    finally:
        if up.proc.poll() is None:
            os.killpg(up.proc.pid, signal.SIGKILL)
    out = up.output()
    assert code == 1, out
    assert "error: router was killed by SIGKILL; stopping the cluster" in out
    assert "restart  router" not in out
    assert "Any part that dies stops the cluster; Ctrl-C stops the cluster." in out
    assert "stopped  nats" in out
    assert all(gone(pid) for pid in pids.values())


def test_a_part_that_cannot_start_makes_tandem_up_give_up_naming_it(tmp_path: Path) -> None:
    # A typo in a path the preflight check does not cover (the mock runner needs no
    # weights): the processor, which loads the tokenizer from it, exits at once, every time.
    cfg = cluster_cfg(model={"name": MODEL, "path": "/nonexistent/SmolLM2-typo.gguf"},
                     launcher={"metrics_port": free_port(), "restart_backoff_s": 0.1,
                               "max_quick_restarts": 2})
    up = start_up(write_config(cfg, tmp_path / "cluster.yaml"), tmp_path / "run",
                  ["--only", "nats,router,processor"])
    try:
        code = up.wait(120)
    finally:
        if up.proc.poll() is None:
            os.killpg(up.proc.pid, signal.SIGKILL)
    out = up.output()
    assert code == 1, out
    assert out.count("restart  processor exited with code 1") == 2
    assert "error: processor exited with code 1: 3 quick failures in a row" in out
    assert "launcher.max_quick_restarts=2; giving up, stopping the cluster" in out
    assert "last lines of processor" in out and "SmolLM2-typo.gguf" in out  # what to fix
    assert "stopped  router" in out and "stopped  nats" in out
    assert all(gone(pid) for pid in up.pids().values())
