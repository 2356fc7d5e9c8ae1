"""The processor and the decode worker are API surfaces too: called directly over gRPC,
each refuses what the frontend refuses, with INVALID_ARGUMENT naming the field, and stays
up to serve the next request."""

from __future__ import annotations

import grpc
import pytest

from services.common.address_book import ChannelPool
from services.common.discovery import Registration
from services.gen import processor_pb2, processor_pb2_grpc, request_pb2, worker_pb2, worker_pb2_grpc
from services.model.tokenizer import Tokenizer
from services.processor.grpc_server import serve_processor
from services.router.router import Router
from tests.support.mock_cluster import MODEL, mock_cluster_cfg
from tests.support.stack import make_processor, worker_decode_node

pytestmark = pytest.mark.asyncio

BAD_SAMPLING = [
    ("temperature", request_pb2.SamplingParams(temperature=float("inf"))),
    ("temperature", request_pb2.SamplingParams(temperature=-0.5)),
    ("top_p", request_pb2.SamplingParams(top_p=float("nan"))),
    ("top_p", request_pb2.SamplingParams(top_p=-1.0)),
    ("top_k", request_pb2.SamplingParams(top_k=(1 << 32) - 1)),
    ("min_p", request_pb2.SamplingParams(min_p=1.5)),
    ("prompt_logprobs", request_pb2.SamplingParams(prompt_logprobs=21)),
    ("stop", request_pb2.SamplingParams(stop=["x"] * 10_000)),
]


@pytest.fixture
def tok(smollm2_tokenizer: Tokenizer) -> Tokenizer:
    return smollm2_tokenizer


async def test_decode_worker_refuses_bad_sampling_and_keeps_serving() -> None:
    cfg = mock_cluster_cfg()
    async with worker_decode_node(cfg) as node, grpc.aio.insecure_channel(node.address) as ch:
        stub = worker_pb2_grpc.DecodeWorkerStub(ch)
        for field, sp in BAD_SAMPLING:
            call = stub.Generate(worker_pb2.GenerateRequest(request_id="r", token_ids=[5, 6],
                                                            sampling=sp))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in call:
                    pass
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert e.value.details().startswith(f"sampling.{field}:"), e.value.details()
        assert node.worker.generate_calls == []  # refused before the worker saw them
        good = request_pb2.SamplingParams(temperature=0.0, max_tokens=3)
        got = [m async for m in stub.Generate(worker_pb2.GenerateRequest(
            request_id="ok", token_ids=[5, 6], sampling=good))]
        assert sum(len(m.token_ids) for m in got) == 3 and got[-1].usage.completion_tokens == 3
        assert node.engine.stats().kv_blocks_used == 0


async def test_processor_refuses_bad_sampling_and_keeps_serving(tok: Tokenizer) -> None:
    cfg = mock_cluster_cfg()
    router = Router(cfg)
    pool = ChannelPool()
    async with worker_decode_node(cfg, tok) as node:
        router.worker_joined(Registration("decode", "w0", address=node.address))
        server, port = await serve_processor(make_processor(cfg, tok, router, 512, pool),
                                             "127.0.0.1", 0)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = processor_pb2_grpc.ProcessorStub(ch)
                for field, sp in BAD_SAMPLING:
                    call = stub.Generate(processor_pb2.ProcessRequest(
                        request_id="r", prompt="hello", sampling=sp))
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        async for _ in call:
                            pass
                    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                    assert e.value.details().startswith(f"sampling.{field}:"), e.value.details()
                bogus = stub.Generate(processor_pb2.ProcessRequest(
                    request_id="r", chat=processor_pb2.ChatMessages(messages=[
                        processor_pb2.ChatMessage(role="bogus", content="hi")])))
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    async for _ in bogus:
                        pass
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "messages.0.role" in e.value.details()
                ok = [m async for m in stub.Generate(processor_pb2.ProcessRequest(
                    request_id="ok", prompt="hello", model=MODEL,
                    sampling=request_pb2.SamplingParams(temperature=0.0, max_tokens=3)))]
                assert ok[-1].usage.completion_tokens == 3
                assert ok[-1].finish_reason == request_pb2.LENGTH
        finally:
            await server.stop(grace=0)
            await pool.close()
