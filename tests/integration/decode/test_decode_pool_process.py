"""`tandem decode --replicas-in-process 2`: one process, two full decode workers (each its
own gRPC port and discovery entry), both gone after SIGTERM with exit 0."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc

from services.common.config import DiscoveryConfig, NatsConfig
from services.common.discovery import Discovery
from services.common.nats_client import connect
from services.gen import request_pb2, worker_pb2, worker_pb2_grpc
from tests.support.mock_cluster import mock_cluster_cfg
from tests.support.ports import free_port_pair
from tests.support.procs import start_part, write_config


async def _generate_one(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as ch:
        stub = worker_pb2_grpc.DecodeWorkerStub(ch)
        req = worker_pb2.GenerateRequest(request_id=f"t-{address}", token_ids=list(range(1000, 1020)),
                                         sampling=request_pb2.SamplingParams(max_tokens=3, top_p=1.0))
        n = 0
        async for resp in stub.Generate(req, timeout=30):
            n += len(resp.token_ids)
        return n


async def test_two_workers_in_one_process(nats_url: str, smollm2_path: Path, tmp_path: Path) -> None:
    base = free_port_pair()  # replica 1 listens on base + 1, and on metrics port + 1
    cfg = mock_cluster_cfg(
        nats_url, namespace="pool",
        engine={"num_kv_blocks": 64, "max_model_len": 256, "mock": {"step_base_s": 0.001}},
        decode={"port": base, "metrics_port": free_port_pair(), "disagg": {"enabled": False}})
    proc = start_part("decode", write_config(cfg, tmp_path / "cluster.yaml"), tmp_path,
                      args=("--replicas-in-process", "2"))
    nc = await connect(NatsConfig(url=nats_url), "pool-test")
    try:
        disc = await Discovery.open(nc, "pool", DiscoveryConfig(ttl_s=2, heartbeat_s=0.5))
        seen: dict[str, str] = {}

        async def joins() -> None:
            async for ev in disc.watch("decode"):
                if ev.kind == "join":
                    seen[ev.registration.instance_id] = ev.registration.address
                if len(seen) == 2:
                    return

        try:
            await asyncio.wait_for(joins(), 60)
        except TimeoutError:
            raise AssertionError(proc.output()) from None
        assert seen == {"decode-0": f"127.0.0.1:{base}", "decode-1": f"127.0.0.1:{base + 1}"}
        assert [await _generate_one(a) for a in sorted(seen.values())] == [3, 3]
    finally:
        code = await asyncio.to_thread(proc.stop, 30)
        await nc.close()
    assert code == 0, proc.output()
