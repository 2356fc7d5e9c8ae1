"""The processor over gRPC with the in-process ``Processor``'s methods (``generate``,
``list_models``) and typed errors, so the frontend takes either."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from services.common.address_book import AddressBook, ChannelPool
from services.gen import processor_pb2, processor_pb2_grpc
from services.processor.grpc_server import CODE_KEY, PARAM_KEY, request_to_pb
from services.processor.types import (
    Delta,
    InvalidRequest,
    ModelInfo,
    ModelNotFound,
    Overloaded,
    ProcessorError,
    ProcessRequest,
    Unavailable,
    Usage,
)

_ERRORS: dict[grpc.StatusCode, type[ProcessorError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.NOT_FOUND: ModelNotFound,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Overloaded,
}


class ProcessorClient:
    """Calls a processor picked from ``book`` (round-robin over live processors)."""

    def __init__(self, book: AddressBook, pool: ChannelPool, list_timeout_s: float = 5.0) -> None:
        self._book = book
        self._pool = pool
        self._timeout = list_timeout_s

    def _stub(self) -> processor_pb2_grpc.ProcessorStub:
        addr = self._book.pick()
        if addr is None:
            raise Unavailable("no processor is registered in discovery")
        return self._pool.stub(addr, processor_pb2_grpc.ProcessorStub)

    async def list_models(self) -> list[ModelInfo]:
        try:
            r = await self._stub().ListModels(processor_pb2.ListModelsRequest(), timeout=self._timeout)
        except grpc.aio.AioRpcError as e:
            raise _translate(e) from None
        return [ModelInfo(m.id, m.context_length) for m in r.models]

    async def generate(self, req: ProcessRequest) -> AsyncIterator[Delta]:
        """Closing the iterator early cancels the call (and so the request on the worker)."""
        call = self._stub().Generate(request_to_pb(req))
        try:
            async for msg in call:
                usage = None
                if msg.HasField("usage"):
                    u = msg.usage
                    usage = Usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens)
                yield Delta(msg.text, msg.finish_reason or None, usage)  # type: ignore[arg-type]
        except grpc.aio.AioRpcError as e:
            raise _translate(e) from None
        finally:
            call.cancel()


def _translate(e: grpc.aio.AioRpcError) -> ProcessorError:
    meta = {k: v for k, v in (e.trailing_metadata() or ()) if isinstance(v, str)}
    cls = _ERRORS.get(e.code(), ProcessorError)
    details = e.details() or e.code().name
    if cls is ProcessorError:
        details = f"processor call failed: {e.code().name}: {details}"
    return cls(details, code=meta.get(CODE_KEY), param=meta.get(PARAM_KEY))
