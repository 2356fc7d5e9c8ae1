"""Cancellation frees everything: 100 streams to the REAL decode worker (mock runner, real
scheduler and KV cache), some through the remote prefill path (a real prefill worker over a
real nats-server), cancelled at random points. Afterwards every engine's used-block gauge is
back to idle, its integrity check passes, and no remote prefill is left waiting or queued."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from services.common.nats_client import Subjects, connect
from services.gen import request_pb2, worker_pb2
from tests.support.disagg_harness import (
    decode_worker,
    metric,
    prefill_worker,
    settle,
)
from tests.support.mock_cluster import mock_cluster_cfg
from tests.support.waits import eventually

pytestmark = pytest.mark.asyncio


def _cfg(nats_url: str):
    return mock_cluster_cfg(
        nats_url, small=True,
        engine={"num_kv_blocks": 256, "mock": {"step_base_s": 0.002, "per_prefill_token_s": 0.0001}},
        decode={"disagg": {"max_local_prefill_length": 16, "remote_prefill_timeout_s": 10.0,
                           "max_prefill_queue_size": 64}},
        prefill={"ack_wait_s": 2.0, "in_progress_interval_s": 0.5})


async def _queued_jobs(cfg) -> int:
    nc = await connect(cfg.nats, "test-queue-probe")
    try:
        info = await nc.jetstream().stream_info(Subjects(cfg.namespace).prefill_stream)
        return int(info.state.messages)
    finally:
        await nc.close()


async def test_cancelled_parked_request_takes_its_job_off_the_queue(nats_url: str) -> None:
    cfg = _cfg(nats_url)
    async with decode_worker(cfg) as d:  # no prefill worker: the job stays queued
        prompt = [(i * 7 + 3) % 997 + 3 for i in range(40)]
        call = d.stub.Generate(worker_pb2.GenerateRequest(
            request_id="parked", token_ids=prompt, sampling=request_pb2.SamplingParams(max_tokens=4)))
        reader = asyncio.create_task(call.read())

        async def parked() -> bool:
            return d.worker.receiver.is_waiting("parked") and await _queued_jobs(cfg) == 1

        await eventually(parked, what="the job to be queued")
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader

        async def retracted() -> bool:
            return await _queued_jobs(cfg) == 0

        await eventually(retracted, what="the job to be deleted from the queue")
        await settle(d.engine, 0)
        assert d.worker.num_inflight == 0 and d.worker.receiver.num_waiting == 0


async def test_100_streams_cancelled_at_random_points_free_every_block(nats_url: str) -> None:
    cfg = _cfg(nats_url)
    rng = random.Random(7)
    async with decode_worker(cfg) as d, prefill_worker(cfg) as p:

        async def one(i: int) -> str:
            n = rng.choice([6, 12, 40, 60])  # > 16 tokens: remote prefill
            prompt = [rng.randrange(3, 997) for _ in range(n)]
            call = d.stub.Generate(worker_pb2.GenerateRequest(
                request_id=f"r{i}", token_ids=prompt,
                sampling=request_pb2.SamplingParams(max_tokens=16, temperature=0)))
            mode = rng.choice(["delay", "after_tokens", "immediately"])
            try:
                if mode == "immediately":
                    call.cancel()
                elif mode == "delay":
                    await asyncio.sleep(rng.uniform(0, 0.08))
                    call.cancel()
                else:
                    k = rng.randrange(1, 12)
                    async for _ in call:
                        k -= 1
                        if k == 0:
                            call.cancel()
                            break
                return (await call.code()).name
            except grpc.aio.AioRpcError as e:
                return e.code().name

        codes: list[str] = []
        for start in range(0, 100, 10):  # 10 at a time: a steady mix of phases in flight
            codes += await asyncio.gather(*(one(i) for i in range(start, start + 10)))
        assert set(codes) <= {"CANCELLED", "OK"}, set(codes)
        assert codes.count("CANCELLED") >= 60
        # Both paths were exercised, and the remote path was cut at every phase.
        assert metric(d.worker, "tandem_worker_prefill_decisions_total", reason="remote") >= 20
        assert metric(d.worker, "tandem_worker_prefill_decisions_total", reason="short") >= 10

        await settle(d.engine, 0)
        await settle(p.engine, 0)
        assert d.worker.num_inflight == 0 and d.worker.receiver.num_waiting == 0
        assert d.worker.queue is not None and d.worker.queue.queued_tokens == 0
        stats = d.engine.stats()
        assert stats.num_running == stats.num_waiting == stats.num_parked == 0

        async def drained() -> bool:
            return p.num_running == 0 and await _queued_jobs(cfg) == 0

        await eventually(drained, what="the prefill queue and worker to drain")
        await settle(p.engine, 0)
        # The gauges an operator watches say the same, on both workers.
        for registry in (d.worker.metrics.registry, p.metrics.registry):
            for gauge in ("kv_blocks_used", "requests_running", "requests_waiting"):
                assert registry.get_sample_value(f"tandem_worker_{gauge}") == 0, gauge
