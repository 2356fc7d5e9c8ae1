"""A draining worker's side of a move (real gRPC over TCP). MoveKv's statuses: a wrong move
token is PERMISSION_DENIED and leaves the request held for its real target; other blocks
than held are FAILED_PRECONDITION and free it; after that, or for a request never held,
NOT_FOUND; the drain then ends with nothing held and no block used. With no other decode
worker registered the drain lets its requests finish instead."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.api.request_codec import sampling_to_pb
from services.api.sampling import SamplingParams
from services.disagg.transfer_token import new_token
from services.gen import worker_pb2, worker_pb2_grpc
from tests.support.mock_cluster import mock_cluster_cfg
from tests.support.stack import worker_decode_node


async def test_move_kv_statuses() -> None:
    cfg = mock_cluster_cfg(engine={"mock": {"step_base_s": 0.01}})
    async with worker_decode_node(cfg, None, "w0") as node, \
            grpc.aio.insecure_channel(node.address) as ch:
        stub = worker_pb2_grpc.DecodeWorkerStub(ch)
        sp = sampling_to_pb(SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
        call = stub.Generate(worker_pb2.GenerateRequest(request_id="r", token_ids=list(range(100, 140)),
                                                        sampling=sp))
        got, drain, moved = 0, None, None
        async for msg in call:
            if msg.HasField("moved"):
                moved = msg.moved
                break
            got += len(msg.token_ids)
            if got >= 3 and drain is None:
                drain = asyncio.create_task(node.worker.drain(10))
        assert moved is not None and moved.address == node.address and len(moved.move_token) == 32
        assert node.worker.outbox.num_held == 1
        n = 40 + got - 1  # prompt + produced, less the last token
        blocks = -(-n // cfg.engine.block_size)

        async def pull(token: bytes, num_tokens: int = n) -> None:
            req = worker_pb2.MoveKvRequest(request_id="r", move_token=token, first_block=0,
                                           num_blocks=blocks, num_tokens=num_tokens,
                                           transfer_token=new_token())
            async for _ in stub.MoveKv(req):
                pass

        with pytest.raises(grpc.aio.AioRpcError) as e:
            await pull(new_token())
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert node.worker.outbox.num_held == 1  # still there for the real target
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await pull(moved.move_token, n + 1)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert node.worker.outbox.num_held == 0  # one pull per held request, whatever its end
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await pull(moved.move_token)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        assert drain is not None and await drain
        assert node.worker.metrics.registry.get_sample_value(
            "tandem_worker_requests_moved_total", {"outcome": "failed"}) == 1
        await node.engine.check_integrity()
        assert node.engine.stats().kv_blocks_used == 0


async def test_with_no_other_decode_worker_a_drain_lets_requests_finish() -> None:
    async def no_peers() -> bool:
        return False

    cfg = mock_cluster_cfg(engine={"mock": {"step_base_s": 0.01}})
    async with worker_decode_node(cfg, None, "w0", has_peers=no_peers) as node, \
            grpc.aio.insecure_channel(node.address) as ch:
        stub = worker_pb2_grpc.DecodeWorkerStub(ch)
        sp = sampling_to_pb(SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
        call = stub.Generate(worker_pb2.GenerateRequest(request_id="r", token_ids=list(range(100, 140)),
                                                        sampling=sp))
        got, drain, last = 0, None, None
        async for msg in call:
            assert not msg.HasField("moved")
            got += len(msg.token_ids)
            last = msg
            if got >= 3 and drain is None:
                drain = asyncio.create_task(node.worker.drain(10))
        assert got == 30 and last is not None and last.finish_reason
        assert drain is not None and await drain
        assert node.worker.outbox.num_held == 0
