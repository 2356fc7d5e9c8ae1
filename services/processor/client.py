"""The processor over gRPC with the in-process ``Processor``'s methods (``generate``,
``list_models``) and typed errors, so the frontend takes either."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from services.api.processor import Delta, ModelInfo, ProcessRequest
from services.api.processor_codec import delta_from_pb, models_from_pb, request_to_pb
from services.common.address_book import AddressBook, ChannelPool
from services.common.errors import Unavailable, from_rpc_error
from services.common.grpc_auth import call_metadata
from services.common.grpc_stream import close_stream
from services.gen import processor_pb2, processor_pb2_grpc


class ProcessorClient:
    """Calls a processor picked from ``book`` (round-robin over live processors)."""

    def __init__(self, book: AddressBook, pool: ChannelPool, list_timeout_s: float = 5.0) -> None:
        self._book = book
        self._pool = pool
        self._timeout = list_timeout_s

    def _stub(self) -> tuple[str, processor_pb2_grpc.ProcessorStub]:
        addr = self._book.pick()
        if addr is None:
            raise Unavailable("no processor is registered in discovery")
        return addr, self._pool.stub(addr, processor_pb2_grpc.ProcessorStub)

    async def list_models(self) -> list[ModelInfo]:
        addr, stub = self._stub()
        try:
            r = await stub.ListModels(processor_pb2.ListModelsRequest(), timeout=self._timeout,
                                      metadata=call_metadata())
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e, f"processor {addr}") from None
        return models_from_pb(r)

    async def generate(self, req: ProcessRequest) -> AsyncIterator[Delta]:
        """Closing the iterator early cancels the call (and so the request on the worker)."""
        addr, stub = self._stub()
        call = stub.Generate(request_to_pb(req), metadata=call_metadata())
        ended = False
        try:
            async for msg in call:
                d = delta_from_pb(msg)
                ended = d.ends_request(req.sampling.n)
                yield d
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e, f"processor {addr}") from None
        finally:
            await close_stream(call, ended)
