"""NATS and router restarts with real processes: two `tandem decode`, one `tandem prefill`,
one `tandem router`, a nats-server killed with SIGKILL and started again on the same port and
store dir. Requests before, during and after complete or fail with a clear error within
their deadline (none hangs); the prefill worker pulls jobs again; the router's index is
rebuilt from worker dumps (a shared-prefix request routes to the holder again)."""

from __future__ import annotations

import asyncio
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from services.api.processor import ProcessRequest
from services.api.route import RequestPhase, RouteRequest
from services.api.sampling import SamplingParams
from services.common.address_book import AddressBook, ChannelPool
from services.common.config import ClusterConfig
from services.common.errors import ServingError, Unavailable
from services.model.tokenizer import Tokenizer
from services.processor.processor import Processor
from services.processor.router_client import RouterClient
from services.processor.worker_client import DecodeWorkerClient
from tests.support.mock_cluster import MODEL, NO_MODEL, mock_cluster_cfg
from tests.support.ports import free_port, free_port_pair
from tests.support.procs import NatsServer, Part, start_part, write_config

pytestmark = pytest.mark.asyncio

PREFIX = list(range(1000, 1064))  # 4 blocks of 16: the shared prefix
DEADLINE_S = 20.0  # every request here must end (either way) within this


def restart_cfg(nats_url: str) -> ClusterConfig:
    return mock_cluster_cfg(
        nats_url, model={"path": NO_MODEL},
        engine={"max_num_seqs": 8, "mock": {"step_base_s": 0.005}},
        decode={"port": free_port_pair(), "metrics_port": free_port_pair(), "grace_period_s": 1,
                "disagg": {"max_local_prefill_length": 16, "remote_prefill_timeout_s": 5}},
        prefill={"metrics_port": free_port(), "grace_period_s": 1},
        router={"port": free_port(), "metrics_port": free_port(), "dump_timeout_s": 2})


def remote_prefills(cfg: ClusterConfig) -> float:
    """Remote prefills done, summed over both decode workers' /metrics."""
    total = 0.0
    for i in range(2):
        try:
            body = urllib.request.urlopen(
                f"http://127.0.0.1:{cfg.decode.metrics_port + i}/metrics", timeout=2).read().decode()
        except OSError:
            continue
        for line in body.splitlines():
            if line.startswith('tandem_worker_prefill_total{where="remote"}'):
                total += float(line.split()[-1])
    return total


async def holder(rc: RouterClient, prompt: list[int], min_overlap: int) -> str | None:
    """The worker the router picks for ``prompt`` if it knows it holds ``min_overlap``
    blocks of it; None otherwise (the route's load is released at once)."""
    rid = f"probe-{uuid.uuid4().hex[:6]}"
    try:
        r = await rc.route(RouteRequest(rid, prompt))
    except Unavailable:  # no worker yet, or the router is restarting
        return None
    await rc.update(rid, RequestPhase.FINISHED)
    return r.worker_id if r.overlap_blocks >= min_overlap else None


async def until(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        v = await check()
        if v:
            return v
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        await asyncio.sleep(0.2)


async def ask(p: Processor, rid: str, prompt: list[int]) -> str:
    """One request, bounded: 'ok' or 'error: ...' (a clear typed error); never hangs."""
    req = ProcessRequest(rid, prompt_ids=tuple(prompt), model=MODEL,
                         sampling=SamplingParams(max_tokens=4, temperature=0))
    try:
        out = await asyncio.wait_for(_drain(p, req), DEADLINE_S)
    except ServingError as e:
        return f"error: {e.message}"
    assert out[-1].finish_reason == "length"
    return "ok"


async def _drain(p: Processor, req: ProcessRequest) -> list:
    return [d async for d in p.generate(req)]


async def test_nats_and_router_restarts(smollm2_path: Path, tmp_path: Path) -> None:
    tok = Tokenizer.from_path(smollm2_path)
    nats = NatsServer(tmp_path / "js")
    nats.start()
    cfg = restart_cfg(nats.url)
    cfg_file = write_config(cfg, tmp_path / "cluster.yaml")
    parts: list[Part] = [start_part("decode", cfg_file, tmp_path, i) for i in range(2)]
    parts += [start_part("prefill", cfg_file, tmp_path), start_part("router", cfg_file, tmp_path)]
    pool = ChannelPool()
    rc = RouterClient(AddressBook("router", f"127.0.0.1:{cfg.router.port}"), pool, timeout_s=2)
    p = Processor(tok, rc, DecodeWorkerClient(pool), MODEL, 512, 16)
    try:
        async def both_workers() -> bool:
            for x in parts:
                assert x.alive(), f"{x.name} died: {x.output()}"
            try:
                a = await rc.route(RouteRequest("w?", [1, 2], exclude_workers=("decode-0",)))
                b = await rc.route(RouteRequest("w?", [1, 2], exclude_workers=("decode-1",)))
            except Unavailable:
                return False
            await rc.update("w?", RequestPhase.FINISHED)
            return {a.worker_id, b.worker_id} == {"decode-0", "decode-1"}

        await until(both_workers, 60, "the router to see both decode workers")
        # Warm the prefix on one worker (prefilled remotely: 68 tokens > 16).
        assert await ask(p, "warm", PREFIX + [7, 7, 7, 7]) == "ok"
        w = await until(lambda: holder(rc, PREFIX + [9] * 20, 4), 10, "the prefix in the index")
        remote_before = remote_prefills(cfg)
        assert remote_before >= 1

        # ---- NATS down: requests end either way within their deadline ----------------
        nats.kill()
        # (Prompts without PREFIX, so only ``w`` ever holds it.)
        during = await asyncio.gather(*(ask(p, f"d{i}", [200 + i] * 50) for i in range(3)))
        assert all(r == "ok" or r.startswith("error: ") for r in during), during
        await asyncio.sleep(cfg.discovery.ttl_s + 1)  # past the discovery TTL, still down
        late = await ask(p, "late", [5] * 40)
        assert late == "ok" or late.startswith("error: "), late

        # ---- NATS back on the same port and store ------------------------------------
        nats.start()
        await until(both_workers, 30, "the router to see both workers after NATS came back")
        assert await until(lambda: holder(rc, PREFIX + [8] * 20, 4), 20,
                           "the index rebuilt after the NATS restart") == w
        # The prefill worker pulls again and the decode workers publish again.
        async def remote_again() -> bool:
            await ask(p, f"r{uuid.uuid4().hex[:4]}", [uuid.uuid4().int % 40000 + 100] * 40)
            return remote_prefills(cfg) > remote_before
        await until(remote_again, 30, "a remote prefill after the NATS restart")

        # ---- router restarted: a new process rebuilds the index from dumps ----------
        parts[3].kill9()
        assert (await ask(p, "norouter", [3] * 40)).startswith("error: ")
        parts[3] = start_part("router", cfg_file, tmp_path)
        await until(both_workers, 60, "the new router to see both workers")
        assert await until(lambda: holder(rc, PREFIX + [6] * 20, 4), 20,
                           "the new router's index rebuilt from dumps") == w
        assert await ask(p, "final", PREFIX + [1] * 30) == "ok"
    finally:
        for x in parts:
            x.kill9()
        nats.kill()
        await pool.close()
