"""Garbage in, error out, service up: raw bytes to every gRPC method (a channel with
identity serializers, so nothing on our side can reject them first) and garbage on every
NATS subject a part listens on. Each gets an error status (KvTransfer: a refusing ack) or is
counted, and a valid call made afterwards still works."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from services.api.wire import decode_dump
from services.common.address_book import ChannelPool
from services.common.discovery import Registration
from services.common.grpc_server import serve_grpc
from services.common.kv_publisher import KvEventPublisher
from services.common.nats_client import Subjects, connect, flush
from services.disagg.prefill_outcome import PrefillLocation
from services.gen import processor_pb2, router_pb2, worker_pb2
from services.model.tokenizer import Tokenizer
from services.processor.grpc_server import serve_processor
from services.router.grpc_server import RouterServicer
from services.router.router import Router
from tests.support.disagg_harness import (
    decode_worker,
    generate,
    prefill_worker,
)
from tests.support.mock_cluster import mock_cluster_cfg
from tests.support.stack import make_processor

pytestmark = pytest.mark.asyncio

# Each fails protobuf parsing: a bad tag, a length past the end, a truncated varint.
GARBAGE = [b"\xff\xff\xff\xff\xff", b"\x0a\xff\x01abc", b"\x08", b"\x12\x05\x80\x80"]
LONG = [(i * 7 + 3) % 997 + 3 for i in range(40)]


async def _raw_unary(channel: grpc.aio.Channel, method: str, payload: bytes) -> grpc.StatusCode:
    try:
        await channel.unary_unary(method)(payload, timeout=5)
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


async def _raw_stream(channel: grpc.aio.Channel, method: str, payload: bytes) -> grpc.StatusCode:
    try:
        async for _ in channel.unary_stream(method)(payload, timeout=5):
            pass
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


async def _raw_client_stream(channel: grpc.aio.Channel, method: str, payload: bytes) -> grpc.StatusCode:
    async def chunks():
        yield payload
        yield payload

    try:
        raw = await channel.stream_unary(method)(chunks(), timeout=5)
    except grpc.aio.AioRpcError as e:
        return e.code()
    # KvTransfer answers a bad transfer in its ack (the sender logs and acks the job).
    ack = worker_pb2.KvTransferAck.FromString(raw)
    assert not ack.accepted and ack.error, ack
    return grpc.StatusCode.INVALID_ARGUMENT


REFUSED = {grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT}


async def test_garbage_to_every_grpc_method_is_refused_and_the_service_stays_up(
        nats_url: str, smollm2_path: Path) -> None:
    cfg = mock_cluster_cfg(nats_url, small=True)
    async with decode_worker(cfg) as d:
        router = Router(cfg)
        await router.start()
        router.worker_joined(Registration("decode", "decode-0", address=d.address))
        rserver, rport = await serve_grpc("router", "127.0.0.1", 0, RouterServicer(router).add_to)
        tok = Tokenizer.from_path(smollm2_path)
        pool = ChannelPool()
        pserver, pport = await serve_processor(
            make_processor(mock_cluster_cfg(), tok, router, 128, pool), "127.0.0.1", 0)
        channels = {name: grpc.aio.insecure_channel(addr) for name, addr in (
            ("decode", d.address), ("router", f"127.0.0.1:{rport}"), ("processor", f"127.0.0.1:{pport}"))}
        try:
            for payload in GARBAGE:
                codes = {
                    "DecodeWorker/Generate": await _raw_stream(
                        channels["decode"], "/tandem.worker.DecodeWorker/Generate", payload),
                    "DecodeWorker/KvTransfer": await _raw_client_stream(
                        channels["decode"], "/tandem.worker.DecodeWorker/KvTransfer", payload),
                    "DecodeWorker/MoveKv": await _raw_stream(
                        channels["decode"], "/tandem.worker.DecodeWorker/MoveKv", payload),
                    "Router/Route": await _raw_unary(
                        channels["router"], "/tandem.router.Router/Route", payload),
                    "Router/Update": await _raw_unary(
                        channels["router"], "/tandem.router.Router/Update", payload),
                    "Processor/Generate": await _raw_stream(
                        channels["processor"], "/tandem.processor.Processor/Generate", payload),
                    "Processor/ListModels": await _raw_unary(
                        channels["processor"], "/tandem.processor.Processor/ListModels", payload),
                }
                bad = {k: c.name for k, c in codes.items() if c not in REFUSED}
                assert not bad, (payload, bad)
            # Still up: valid calls to each service succeed.
            r = await generate(d, "after-garbage", LONG[:8], max_tokens=3)
            assert len(r.tokens) == 3
            route = await channels["router"].unary_unary(
                "/tandem.router.Router/Route",
                request_serializer=router_pb2.RouteRequest.SerializeToString,
                response_deserializer=router_pb2.RouteResponse.FromString,
            )(router_pb2.RouteRequest(request_id="x", token_ids=[1, 2, 3]), timeout=5)
            assert route.worker_id == "decode-0"
            models = await channels["processor"].unary_unary(
                "/tandem.processor.Processor/ListModels",
                request_serializer=processor_pb2.ListModelsRequest.SerializeToString,
                response_deserializer=processor_pb2.ListModelsResponse.FromString,
            )(processor_pb2.ListModelsRequest(), timeout=5)
            assert len(models.models) == 1
            await d.engine.check_integrity()
            assert d.engine.stats().kv_blocks_used == 0
        finally:
            for ch in channels.values():
                await ch.close()
            await pserver.stop(0)
            await rserver.stop(0)
            await pool.close()
            await router.close()


async def test_garbage_on_every_nats_subject_is_counted_and_the_parts_stay_up(nats_url: str) -> None:
    cfg = mock_cluster_cfg(nats_url, small=True,
                           decode={"disagg": {"max_local_prefill_length": 16}},
                           prefill={"ack_wait_s": 2.0, "in_progress_interval_s": 0.5})
    subjects = Subjects(cfg.namespace)
    nc = await connect(cfg.nats, "test-garbage")
    router = Router(cfg)
    await router.start()
    try:
        async with decode_worker(cfg) as d, prefill_worker(cfg) as p, \
                KvEventPublisher(nc, subjects, "decode-0", dump=d.engine.dump_kv_events):
            js = nc.jetstream()
            for payload in GARBAGE:
                await js.publish(subjects.prefill_queue, payload)
                await nc.publish(subjects.kv_events("decode-0"), payload)
                await nc.publish(subjects.load("decode-0"), payload)
                await nc.publish(subjects.router_inflight, payload)
                # A dump request's body is ignored: garbage still gets a well-formed dump.
                reply = await nc.request(subjects.kv_dump("decode-0"), payload, timeout=5)
                assert decode_dump(reply.data).worker_id == "decode-0"
            await flush(nc)

            def count(kind: str) -> float:
                v = router.metrics.registry.get_sample_value(
                    "tandem_router_bad_messages_total", {"kind": kind})
                return v or 0.0

            def malformed_jobs() -> float:
                v = p.metrics.registry.get_sample_value("tandem_prefill_jobs_total",
                                                        {"outcome": "malformed"})
                return v or 0.0

            deadline = asyncio.get_running_loop().time() + 10
            while not (count("kv_events") == count("load") == count("inflight") == len(GARBAGE)
                       and malformed_jobs() == len(GARBAGE)):
                assert asyncio.get_running_loop().time() < deadline, (
                    count("kv_events"), count("load"), count("inflight"), malformed_jobs())
                await asyncio.sleep(0.05)
            # Still up: a remote prefill goes through the same queue and prefill worker.
            r = await generate(d, "after-garbage", LONG, max_tokens=4)
            assert r.where == PrefillLocation.REMOTE and len(r.tokens) == 4
            await d.engine.check_integrity()
            await p.engine.check_integrity()
    finally:
        await router.close()
        await nc.close()
