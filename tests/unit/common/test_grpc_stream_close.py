"""How the streaming clients let go of a call, over real gRPC: a call whose request
finished (DecodeWorkerClient: every choice; ProcessorClient: the delta that ends the
request) is left to end with the server's status, even when the consumer stops at that
last item (a cancel there races the trailing status and the server logs an
ExecuteBatchError); a stream the consumer leaves early is cancelled on the server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import grpc
import pytest

from services.api.outputs import FinishReason, TokenOutput, Usage
from services.api.processor import Delta, ProcessRequest
from services.api.processor_codec import delta_to_pb
from services.api.sampling import SamplingParams
from services.api.worker_codec import output_to_pb
from services.common.address_book import AddressBook, ChannelPool
from services.common.grpc_server import serve_grpc
from services.gen import processor_pb2_grpc, worker_pb2_grpc
from services.processor.client import ProcessorClient
from services.processor.worker_client import DecodeWorkerClient

pytestmark = pytest.mark.asyncio


class Server:
    """Streams ``items`` messages ``step_s`` apart, the last one ending the request, then
    takes a while to close (as the real worker does closing its engine iterator); records
    how each call ended."""

    def __init__(self, items: int, message: Callable[[int, bool], object], step_s: float) -> None:
        self.items, self.message, self.step_s = items, message, step_s
        self.endings: list[str] = []

    async def Generate(self, request, context: grpc.aio.ServicerContext):  # noqa: N802
        try:
            for i in range(self.items):
                yield self.message(i, i == self.items - 1)
                await asyncio.sleep(self.step_s)
            await asyncio.sleep(0.2)
            self.endings.append("returned")
        except asyncio.CancelledError:
            self.endings.append("cancelled")
            raise

    async def until_ended(self) -> None:
        async with asyncio.timeout(5):
            while not self.endings:
                await asyncio.sleep(0.01)


def _worker_output(i: int, last: bool):
    out = TokenOutput("r", [100 + i], finished=last,
                      finish_reason=FinishReason.LENGTH if last else None, num_prompt_tokens=3)
    return output_to_pb(out, i + 1)


def _delta(i: int, last: bool):
    return delta_to_pb(Delta(f"t{i}", FinishReason.LENGTH if last else None,
                             Usage(3, i + 1) if last else None))


class Decode(Server, worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, items: int, step_s: float = 0.0) -> None:
        Server.__init__(self, items, _worker_output, step_s)


class Processor(Server, processor_pb2_grpc.ProcessorServicer):
    def __init__(self, items: int, step_s: float = 0.0) -> None:
        Server.__init__(self, items, _delta, step_s)


async def _stream(kind: str, server: Server, n_items: int):
    """Serve ``server``; the server, the channel pool and a function opening the client's
    stream of ``n_items``."""
    add = (worker_pb2_grpc.add_DecodeWorkerServicer_to_server if kind == "decode"
           else processor_pb2_grpc.add_ProcessorServicer_to_server)
    srv, port = await serve_grpc(kind, "127.0.0.1", 0, lambda s: add(server, s))
    addr = f"127.0.0.1:{port}"
    pool = ChannelPool()
    sampling = SamplingParams(max_tokens=n_items)

    def open_stream() -> AsyncIterator:
        if kind == "decode":
            return DecodeWorkerClient(pool).generate(addr, "r", [1, 2, 3], sampling)
        return ProcessorClient(AddressBook("processor", fixed=addr), pool).generate(
            ProcessRequest("r", prompt="hi", sampling=sampling))
    return srv, pool, open_stream


def _ends(kind: str, item) -> bool:
    return item.finished if kind == "decode" else item.ends_request(1)


@pytest.mark.parametrize("kind", ["decode", "processor"])
@pytest.mark.parametrize("leave", ["exhaust", "break_at_last"])
async def test_a_finished_call_ends_with_the_servers_status_not_a_cancel(kind: str, leave: str) -> None:
    server = Decode(3) if kind == "decode" else Processor(3)
    srv, pool, open_stream = await _stream(kind, server, 3)
    try:
        items = []
        stream = open_stream()
        async for item in stream:
            items.append(item)
            if leave == "break_at_last" and _ends(kind, item):
                break
        await stream.aclose()
        assert len(items) == 3 and _ends(kind, items[-1])
        assert not any(_ends(kind, x) for x in items[:-1])
        await server.until_ended()
        assert server.endings == ["returned"]
    finally:
        await pool.close()
        await srv.stop(None)


@pytest.mark.parametrize("kind", ["decode", "processor"])
async def test_a_stream_left_before_its_end_is_cancelled_on_the_server(kind: str) -> None:
    server = Decode(50, step_s=0.05) if kind == "decode" else Processor(50, step_s=0.05)
    srv, pool, open_stream = await _stream(kind, server, 50)
    try:
        stream = open_stream()
        first = await anext(stream)
        assert not _ends(kind, first)
        await stream.aclose()
        await server.until_ended()
        assert server.endings == ["cancelled"]
    finally:
        await pool.close()
        await srv.stop(None)
