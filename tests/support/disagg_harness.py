"""In-process wiring of decode and prefill workers for the disaggregation tests: real
nats-server, real gRPC over TCP on 127.0.0.1, engines built from the cluster config. A
decode worker registers in discovery with its KvTransfer address, as `tandem decode` does:
prefill workers send KV only to addresses listed there."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc

from services.api.outputs import TokenLogprob
from services.api.request_codec import logprob_from_pb
from services.api.sampling import SamplingParams
from services.api.worker_codec import generate_request_to_pb
from services.common.config import ClusterConfig
from services.common.discovery import Discovery, Registration
from services.common.nats_client import Subjects, connect
from services.decode.grpc_server import serve_decode_worker
from services.decode.worker import DecodeWorker
from services.disagg.prefill_outcome import PrefillLocation
from services.disagg.prefill_queue import PrefillQueue
from services.engine.async_engine import AsyncEngine
from services.engine.factory import build_engine
from services.gen import request_pb2, worker_pb2_grpc
from services.prefill.worker import PrefillWorker


@dataclass
class DecodeHandle:
    worker: DecodeWorker
    engine: AsyncEngine
    address: str
    stub: worker_pb2_grpc.DecodeWorkerStub


@asynccontextmanager
async def decode_worker(cfg: ClusterConfig, worker_id: str = "decode-0") -> AsyncIterator[DecodeHandle]:
    parts = build_engine(cfg, worker_id=worker_id)
    nc = await connect(cfg.nats, f"test-{worker_id}")
    async with AsyncEngine(parts.engine) as ae:
        queue = await PrefillQueue.open(nc, Subjects(cfg.namespace), cfg.prefill,
                                        cfg.decode.disagg.queue_depth_cache_s, worker_id)
        worker = DecodeWorker(ae, cfg, worker_id, queue)
        server, port = await serve_decode_worker(worker, "127.0.0.1", 0)
        worker.kv_address = f"127.0.0.1:{port}"
        discovery = await Discovery.open(nc, cfg.namespace, cfg.discovery)
        lease = await discovery.register(Registration("decode", worker_id, address=worker.kv_address))
        channel = grpc.aio.insecure_channel(worker.kv_address)
        try:
            yield DecodeHandle(worker, ae, worker.kv_address, worker_pb2_grpc.DecodeWorkerStub(channel))
        finally:
            await lease.close()
            await channel.close()
            await server.stop(grace=0)
            await worker.close()
    await nc.close()


@asynccontextmanager
async def prefill_worker(cfg: ClusterConfig, worker_id: str = "prefill-0") -> AsyncIterator[PrefillWorker]:
    parts = build_engine(cfg, worker_id=worker_id)
    nc = await connect(cfg.nats, f"test-{worker_id}")
    async with AsyncEngine(parts.engine) as ae:
        pw = PrefillWorker(ae, nc, cfg, worker_id)
        await pw.start()
        try:
            yield pw
        finally:
            await pw.close()
    await nc.close()


@dataclass
class Result:
    tokens: list[int]
    where: PrefillLocation | None  # None: asked through a bare stub (no metrics to read)
    finish: int
    usage: request_pb2.Usage
    logprobs: list[TokenLogprob] = field(default_factory=list)  # with sampling.logprobs


def _prefills(worker: DecodeWorker) -> dict[PrefillLocation, float]:
    return {w: metric(worker, "tandem_worker_prefill_total", where=w.value) for w in PrefillLocation}


async def generate(target: DecodeHandle | worker_pb2_grpc.DecodeWorkerStub, rid: str,
                   prompt: list[int], max_tokens: int = 8, **sampling: Any) -> Result:
    """One request over gRPC. With a DecodeHandle, ``where`` is the location whose
    tandem_worker_prefill_total counter the request moved (requests one at a time)."""
    handle = target if isinstance(target, DecodeHandle) else None
    stub = handle.stub if handle is not None else target
    before = _prefills(handle.worker) if handle is not None else {}
    sp = SamplingParams(temperature=sampling.pop("temperature", 0.0), max_tokens=max_tokens, **sampling)
    call = stub.Generate(generate_request_to_pb(rid, prompt, sp))
    tokens: list[int] = []
    logprobs: list[TokenLogprob] = []
    finish = 0
    usage = request_pb2.Usage()
    async for m in call:
        tokens += m.token_ids
        logprobs += [logprob_from_pb(x) for x in m.logprobs]
        if m.finish_reason:
            finish, usage = m.finish_reason, m.usage
    where = None
    if handle is not None:
        grew = [w for w, n in _prefills(handle.worker).items() if n > before[w]]
        assert len(grew) == 1, f"{rid}: prefill counters moved for {grew}"
        where = grew[0]
    return Result(tokens, where, finish, usage, logprobs)


def metric(worker: DecodeWorker, name: str, **labels: str) -> float:
    v = worker.metrics.registry.get_sample_value(name, labels or None)
    return 0.0 if v is None else v


async def settle(engine: AsyncEngine, baseline: int, timeout: float = 5.0) -> None:
    """Wait until the engine's used blocks are back to ``baseline`` (fail, not hang)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while engine.stats().kv_blocks_used != baseline:
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"kv_blocks_used {engine.stats().kv_blocks_used} != baseline {baseline}")
        await asyncio.sleep(0.02)
    await engine.check_integrity()
