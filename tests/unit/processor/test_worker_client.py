"""DecodeWorkerClient over real gRPC: a call whose choices all finished is left to end with
the worker's status (a cancel there races the trailing status and the worker's server logs
an ExecuteBatchError); a stream the consumer leaves early is cancelled on the worker."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from services.api.outputs import FinishReason, TokenOutput
from services.api.sampling import SamplingParams
from services.api.worker_codec import output_to_pb
from services.common.address_book import ChannelPool
from services.common.grpc_server import serve_grpc
from services.gen import worker_pb2_grpc
from services.processor.worker_client import DecodeWorkerClient

pytestmark = pytest.mark.asyncio


class Worker(worker_pb2_grpc.DecodeWorkerServicer):
    """Streams ``tokens`` outputs a ``step_s`` apart, the last one finished, then takes a
    while to close (as the real worker does closing its engine iterator); records how each
    call ended."""

    def __init__(self, tokens: int, step_s: float = 0.0) -> None:
        self.tokens, self.step_s = tokens, step_s
        self.endings: list[str] = []

    async def Generate(self, request, context: grpc.aio.ServicerContext):  # noqa: N802
        try:
            for i in range(self.tokens):
                last = i == self.tokens - 1
                out = TokenOutput(request.request_id, [100 + i], finished=last,
                                  finish_reason=FinishReason.LENGTH if last else None,
                                  num_prompt_tokens=3)
                yield output_to_pb(out, i + 1)
                await asyncio.sleep(self.step_s)
            await asyncio.sleep(0.2)
            self.endings.append("returned")
        except asyncio.CancelledError:
            self.endings.append("cancelled")
            raise


async def _serve(worker: Worker) -> tuple[grpc.aio.Server, str]:
    server, port = await serve_grpc(
        "decode worker", "127.0.0.1", 0,
        lambda s: worker_pb2_grpc.add_DecodeWorkerServicer_to_server(worker, s))
    return server, f"127.0.0.1:{port}"


async def _until_ended(worker: Worker, n: int) -> None:
    async with asyncio.timeout(5):
        while len(worker.endings) < n:
            await asyncio.sleep(0.01)


@pytest.mark.parametrize("leave", ["exhaust", "break_after_last"])
async def test_a_finished_call_ends_with_the_workers_status_not_a_cancel(leave: str) -> None:
    worker = Worker(tokens=3)
    server, addr = await _serve(worker)
    pool = ChannelPool()
    try:
        client = DecodeWorkerClient(pool)
        outs: list[TokenOutput] = []
        stream: AsyncIterator[TokenOutput] = client.generate(addr, "r1", [1, 2, 3],
                                                             SamplingParams(max_tokens=3))
        async for o in stream:
            outs.append(o)
            if leave == "break_after_last" and o.finished:
                break
        await stream.aclose()
        assert [o.token_ids for o in outs] == [[100], [101], [102]]
        assert outs[-1].finished and outs[-1].finish_reason is FinishReason.LENGTH
        await _until_ended(worker, 1)
        assert worker.endings == ["returned"]
    finally:
        await pool.close()
        await server.stop(None)


async def test_a_stream_left_before_its_end_is_cancelled_on_the_worker() -> None:
    worker = Worker(tokens=50, step_s=0.05)
    server, addr = await _serve(worker)
    pool = ChannelPool()
    try:
        stream = DecodeWorkerClient(pool).generate(addr, "r2", [1, 2, 3],
                                                   SamplingParams(max_tokens=50))
        first = await anext(stream)
        assert not first.finished
        await stream.aclose()
        await _until_ended(worker, 1)
        assert worker.endings == ["cancelled"]
    finally:
        await pool.close()
        await server.stop(None)
