"""A prefill and a decode worker whose KV layouts cannot be resharded refuse at startup,
each naming both layouts -- whichever starts second; a peer that differs only in its
tensor-parallel size is accepted (KV crosses the wire in the whole model's layout)."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import replace
from pathlib import Path

import pytest

from services.common.config import ClusterConfig, NatsConfig
from services.common.discovery import Discovery, Registration
from services.common.nats_client import connect
from services.disagg.kv_layout import METADATA_KEY, KvLayout
from tests.support.mock_cluster import NO_MODEL, mock_cluster_cfg
from tests.support.ports import free_port
from tests.support.procs import start_part, write_config

pytestmark = pytest.mark.asyncio

# What a mock-runner worker with block_size 16 announces (services/engine/runner/mock_runner.py).
MOCK = KvLayout(layers=1, kv_heads=1, head_dim=1, block_size=16, dtype="float32", tp=1)


def _cfg(nats_url: str, ns: str) -> ClusterConfig:
    return mock_cluster_cfg(nats_url, namespace=ns, model={"path": NO_MODEL},
                            engine={"num_kv_blocks": 64, "max_model_len": 256},
                            decode={"port": free_port(), "metrics_port": free_port()},
                            prefill={"metrics_port": free_port()}, discovery={"ttl_s": 30})


@pytest.mark.parametrize(("part", "peer_role"), [("decode", "prefill"), ("prefill", "decode")])
async def test_incompatible_peer_is_refused_at_startup(nats_url: str, tmp_path: Path, part: str,
                                                       peer_role: str) -> None:
    ns = f"t{uuid.uuid4().hex[:10]}"
    cfg = _cfg(nats_url, ns)
    nc = await connect(NatsConfig(url=nats_url), "layout-test")
    disc = await Discovery.open(nc, ns, cfg.discovery)
    bad = KvLayout(layers=1, kv_heads=2, head_dim=1, block_size=16, dtype="bfloat16", tp=1)
    lease = await disc.register(Registration(peer_role, f"{peer_role}-9", address="127.0.0.1:1",
                                             metadata={METADATA_KEY: bad.encode()}))
    proc = start_part(part, write_config(cfg, tmp_path / "cluster.yaml"), tmp_path)
    try:
        code = await asyncio.to_thread(proc.wait, 120)
        out = proc.output()
        assert code not in (None, 0), out
        assert f"{part} worker refuses to start" in out
        assert f"[{MOCK.encode()}]" in out and f"[{bad.encode()}]" in out
        assert "kv_heads, dtype differ" in out
        assert not [r for r in await disc.registrations(part)], "it never registered"
    finally:
        proc.kill9()
        await lease.close()
        await nc.close()


async def test_peer_differing_only_in_tp_size_is_accepted(nats_url: str, tmp_path: Path) -> None:
    ns = f"t{uuid.uuid4().hex[:10]}"
    cfg = _cfg(nats_url, ns)
    nc = await connect(NatsConfig(url=nats_url), "layout-test")
    disc = await Discovery.open(nc, ns, cfg.discovery)
    peer = replace(MOCK, tp=3)
    lease = await disc.register(Registration("prefill", "prefill-9", metadata={METADATA_KEY: peer.encode()}))
    proc = start_part("decode", write_config(cfg, tmp_path / "cluster.yaml"), tmp_path)
    try:
        for _ in range(1200):
            regs = await disc.registrations("decode")
            if regs:
                assert KvLayout.parse(regs[0].metadata[METADATA_KEY]) == MOCK
                break
            proc.assert_alive()
            await asyncio.sleep(0.1)
        else:
            raise AssertionError(f"decode never registered: {proc.output()}")
    finally:
        proc.kill9()
        await lease.close()
        await nc.close()
