"""Forged remote-prefill traffic against real workers (real nats-server, real gRPC, mock
runner): a KvTransfer without the request's token is refused and the real one still lands
(nothing poisoned), and a prefill worker sends KV only to the address discovery lists for
the job's decode worker (docs/architecture.md, "Prefill queue" and "gRPC services")."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
import pytest
import torch

from services.api.prefill import PrefillJob
from services.api.prefill_codec import job_from_bytes, job_to_pb
from services.api.sampling import SamplingParams
from services.common.discovery import Discovery, Registration
from services.common.nats_client import Subjects, connect
from services.disagg.prefill_outcome import PrefillLocation
from services.disagg.transfer_token import new_token
from services.gen import worker_pb2
from services.prefill.kv_sender import KvSender
from tests.support.disagg_harness import (
    decode_worker,
    generate,
    metric,
    prefill_worker,
    settle,
)
from tests.support.mock_cluster import mock_cluster_cfg

pytestmark = pytest.mark.asyncio

BS = 4  # SMALL_ENGINE's block size
PROMPT = [(i * 17 + 11) % 983 + 3 for i in range(42)]  # 10 full blocks and a partial one
MORE = [(i * 5 + 1) % 977 + 3 for i in range(8)]  # a later request: PROMPT's blocks + these


def _poisoned(job: PrefillJob, shape: tuple[int, ...]) -> torch.Tensor:
    """KV that would pass every header check and import quietly: the mock runner's K holds
    token ids (here wrong ones) and V positions + 1 (here right, so nothing trips)."""
    kv = torch.zeros(shape)
    for b in range(shape[2]):
        for j in range(BS):
            pos = (job.first_block + b) * BS + j
            if pos < len(job.token_ids):
                kv[0, 0, b, j, 0, 0] = (job.token_ids[pos] + 1) % 997
                kv[0, 1, b, j, 0, 0] = pos + 1
    return kv


async def test_forged_kv_transfers_are_refused_and_the_real_one_lands_unpoisoned(nats_url: str) -> None:
    cfg = mock_cluster_cfg(nats_url, small=True,
                           decode={"disagg": {"max_local_prefill_length": 16}})
    subjects = Subjects(cfg.namespace)
    spy = await connect(cfg.nats, "queue-reader")
    jobs: asyncio.Queue[PrefillJob] = asyncio.Queue()

    async def on_job(msg) -> None:
        jobs.put_nowait(job_from_bytes(msg.data))

    # What the outside tester did: a plain subscriber reads every job on the queue subject.
    await spy.subscribe(subjects.prefill_queue, cb=on_job)
    forger = KvSender("forger", chunk_bytes=256)
    try:
        async with decode_worker(cfg) as d:
            baseline = d.engine.stats().kv_blocks_used
            call = asyncio.create_task(generate(d, "victim", PROMPT, max_tokens=6))
            job = await asyncio.wait_for(jobs.get(), 10)  # no prefill worker yet: it waits
            kv = _poisoned(job, d.engine.kv_spec.block_range_shape(job.num_blocks))
            for shm in (False, True):
                for token in (b"", new_token()):
                    sent = await forger.send(job.kv_transfer_address, job.request_id, kv, 123,
                                             job.first_block, timeout_s=5, shm=shm, token=token)
                    assert not sent.ack.accepted and "transfer token" in sent.ack.error, sent.ack
            for reason in ("no_token", "bad_token"):
                assert metric(d.worker, "tandem_worker_kv_transfers_refused_total", reason=reason) == 2
            assert metric(d.worker, "tandem_worker_kv_transfer_bytes_received_total") == 0
            assert not call.done() and d.worker.receiver.is_waiting("victim")
            # The real prefill worker still delivers, with the token from the job.
            async with prefill_worker(cfg) as p:
                r = await asyncio.wait_for(call, 20)
                assert p.metrics.registry.get_sample_value(
                    "tandem_prefill_jobs_total", {"outcome": "delivered"}) == 1
            assert r.where == PrefillLocation.REMOTE and len(r.tokens) == 6
            assert metric(d.worker, "tandem_worker_kv_transfer_bytes_received_total") == kv.nbytes
            # A later request on the same prefix reads the imported blocks from the cache.
            later = await generate(d, "later", PROMPT + MORE, max_tokens=6)
            assert later.where == PrefillLocation.LOCAL and later.usage.cached_tokens >= 40
            await settle(d.engine, baseline)
            await d.engine.check_integrity()
        cfg_local = cfg.model_copy(update={"decode": cfg.decode.model_copy(
            update={"disagg": cfg.decode.disagg.model_copy(update={"enabled": False})})})
        async with decode_worker(cfg_local, "decode-local") as d2:
            assert (await generate(d2, "victim", PROMPT, max_tokens=6)).tokens == r.tokens
            assert (await generate(d2, "later", PROMPT + MORE, max_tokens=6)).tokens == later.tokens
    finally:
        await forger.close()
        await spy.close()


class FakeKvServer:
    """A KvTransfer endpoint that only counts what reaches it."""

    def __init__(self) -> None:
        self.calls = 0
        self.bytes = 0
        self.address = ""
        self._server: grpc.aio.Server | None = None

    async def _kv_transfer(self, chunks, context) -> worker_pb2.KvTransferAck:
        self.calls += 1
        async for raw in chunks:
            self.bytes += len(raw)
        return worker_pb2.KvTransferAck(accepted=False, error="fake decode worker")

    async def start(self) -> None:
        handler = grpc.method_handlers_generic_handler("tandem.worker.DecodeWorker", {
            "KvTransfer": grpc.stream_unary_rpc_method_handler(
                self._kv_transfer, request_deserializer=None,
                response_serializer=worker_pb2.KvTransferAck.SerializeToString)})
        self._server = grpc.aio.server()
        self._server.add_generic_rpc_handlers((handler,))
        self.address = f"127.0.0.1:{self._server.add_insecure_port('127.0.0.1:0')}"
        await self._server.start()

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=0)


@asynccontextmanager
async def fake_servers(n: int) -> AsyncIterator[list[FakeKvServer]]:
    fakes = [FakeKvServer() for _ in range(n)]
    for f in fakes:
        await f.start()
    try:
        yield fakes
    finally:
        for f in fakes:
            await f.stop()


def _job(rid: str, decode_worker_id: str, address: str, token: bytes | None = None) -> bytes:
    job = PrefillJob(rid, tuple(PROMPT[:12]), SamplingParams(temperature=0), decode_worker_id,
                     address, 0, 3, int((time.time() + 30) * 1000),
                     transfer_token=new_token() if token is None else token)
    return job_to_pb(job).SerializeToString()


async def test_prefill_worker_sends_kv_only_to_the_listed_address_of_the_jobs_decode_worker(
        nats_url: str, wait_for) -> None:
    cfg = mock_cluster_cfg(nats_url, small=True,
                           prefill={"discovery_wait_s": 1.5, "nak_delay_s": 0.05})
    subjects = Subjects(cfg.namespace)
    nc = await connect(cfg.nats, "job-forger")
    js = nc.jetstream()
    disc = await Discovery.open(nc, cfg.namespace, cfg.discovery)
    leases = []
    try:
        async with fake_servers(3) as (foreign, listed, late), decode_worker(cfg) as d, \
                prefill_worker(cfg) as p:
            # "decode-1" is a registered decode worker whose address is the fake `listed`.
            leases.append(await disc.register(Registration("decode", "decode-1", address=listed.address)))
            await wait_for(lambda: p.decode_workers.check("decode-1", listed.address) is None,
                           what="discovery")

            def outcome(name: str, label: str = "outcome") -> float:
                metric_name = ("tandem_prefill_jobs_total" if label == "outcome"
                               else "tandem_prefill_jobs_refused_total")
                return p.metrics.registry.get_sample_value(metric_name, {label: name}) or 0.0

            for payload in (
                _job("foreign", "decode-0", foreign.address),  # an address nobody registered
                _job("wrong-id", "decode-0", listed.address),  # registered, but by decode-1
                _job("unknown", "decode-9", foreign.address),  # no such decode worker
                _job("no-token", "decode-1", listed.address, token=b""),
            ):
                await js.publish(subjects.prefill_queue, payload)
            await wait_for(lambda: outcome("refused") == 4, timeout=10, what="refusals")
            assert outcome("address_mismatch", "reason") == 2
            assert outcome("unknown_decode_worker", "reason") == 1
            assert outcome("no_token", "reason") == 1
            # Start-up race: a job whose decode worker registers just after it was published.
            await js.publish(subjects.prefill_queue, _job("late", "decode-2", late.address))
            await asyncio.sleep(0.3)
            leases.append(await disc.register(Registration("decode", "decode-2", address=late.address)))
            # Control: a job consistent with discovery is run and its KV sent.
            await js.publish(subjects.prefill_queue, _job("ok", "decode-1", listed.address))
            await wait_for(lambda: outcome("rejected") == 2, timeout=10, what="the sent jobs")
            assert (late.calls, listed.calls) == (1, 1) and listed.bytes > 0
            # Terminated, not retried: nothing comes back after a redelivery delay.
            await asyncio.sleep(0.5)
            info = await js.consumer_info(subjects.prefill_stream, subjects.prefill_consumer)
            assert info.num_pending == 0 and info.num_ack_pending == 0
            assert outcome("refused") == 4 and outcome("failed") == 0
            assert foreign.calls == 0 and foreign.bytes == 0  # nothing ever went there
            assert d.worker.receiver.num_waiting == 0
            assert metric(d.worker, "tandem_worker_kv_transfers_refused_total", reason="not_waiting") == 0
            await p.engine.check_integrity()
    finally:
        for lease in leases:
            await lease.close()
        await nc.close()
