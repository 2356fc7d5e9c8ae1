"""`tandem decode` and `tandem prefill` as processes: they register in discovery, serve
Generate (remote prefill through the real queue) and /metrics, and on SIGTERM deregister
and exit 0."""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path

import grpc
import pytest

from services.common.discovery import Discovery
from services.common.nats_client import connect
from services.gen import worker_pb2_grpc
from tests.support.disagg_harness import generate
from tests.support.mock_cluster import mock_cluster_cfg
from tests.support.ports import free_port
from tests.support.procs import start_part, stop_parts, write_config

pytestmark = pytest.mark.asyncio



async def test_decode_and_prefill_processes_serve_and_exit_cleanly(nats_url: str, tmp_path: Path) -> None:
    dport, mport, pport = free_port(), free_port(), free_port()
    cfg = mock_cluster_cfg(nats_url, small=True,
                           decode={"port": dport, "metrics_port": mport, "grace_period_s": 2,
                                   "disagg": {"max_local_prefill_length": 16}},
                           prefill={"metrics_port": pport},
                           discovery={"ttl_s": 5, "heartbeat_s": 1})
    cfg_file = write_config(cfg, tmp_path / "cluster.yaml")
    parts = [start_part(part, cfg_file, tmp_path) for part in ("decode", "prefill")]
    nc = await connect(cfg.nats, "observer")
    try:
        disc = await Discovery.open(nc, cfg.namespace, cfg.discovery)
        seen: dict[str, str] = {}

        async def watch() -> None:
            async for ev in disc.watch("decode"):
                seen[ev.registration.instance_id] = ev.kind
        watcher = asyncio.create_task(watch())
        async def watch_prefill() -> None:
            async for ev in disc.watch("prefill"):
                seen[ev.registration.instance_id] = ev.kind
        watcher2 = asyncio.create_task(watch_prefill())
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        while seen.get("decode-0") != "join" or seen.get("prefill-0") != "join":
            for p in parts:
                p.assert_alive()
            assert loop.time() < deadline, f"workers did not register: {seen}"
            await asyncio.sleep(0.1)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{dport}") as ch:
            stub = worker_pb2_grpc.DecodeWorkerStub(ch)
            r = await generate(stub, "p1", list(range(10, 50)), max_tokens=4)
            assert len(r.tokens) == 4
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await generate(stub, "bad", [], max_tokens=4)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        body = await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics").read().decode())
        assert 'tandem_worker_prefill_total{where="remote"} 1.0' in body
        assert "tandem_worker_kv_blocks_total 128.0" in body
        # where the request's time went: parked at once, prefilled remotely, 3 decode steps
        for phase in ("queue", "prefill", "decode"):
            assert f"tandem_worker_request_{phase}_seconds_count 1.0" in body
        assert 'tandem_worker_engine_step_seconds_count{kind="decode"} 3.0' in body
        assert 'tandem_worker_engine_step_seconds_count{kind="prefill"} 0.0' in body
        # two processes on one host: the KV went through /dev/shm
        pbody = await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{pport}/metrics").read().decode())
        assert 'tandem_prefill_kv_transfers_total{transport="shm"} 1.0' in pbody
        assert 'tandem_worker_engine_step_seconds_count{kind="prefill"} 1.0' in pbody
        codes = await asyncio.to_thread(stop_parts, parts, 20)
        assert codes == {"decode-0": 0, "prefill-0": 0}, (codes, *(p.output() for p in parts))
        deadline = loop.time() + 5
        while seen.get("decode-0") != "leave" or seen.get("prefill-0") != "leave":
            assert loop.time() < deadline, f"workers did not deregister: {seen}"
            await asyncio.sleep(0.05)
        watcher.cancel()
        watcher2.cancel()
    finally:
        for p in parts:
            p.kill9()
        await nc.close()
