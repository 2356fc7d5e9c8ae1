"""The decode worker's ``Generate`` stream over gRPC (proto/worker.proto), as typed chunks.

Closing the iterator (break + aclose, or the consuming task cancelled) cancels the gRPC
call, which aborts the request on the worker.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc

from services.common.address_book import ChannelPool
from services.engine.request import FinishReason, SamplingParams
from services.gen import worker_pb2, worker_pb2_grpc
from services.processor.types import InvalidRequest, Overloaded, ProcessorError, Unavailable

_FINISH = {
    worker_pb2.STOP: FinishReason.STOP,
    worker_pb2.LENGTH: FinishReason.LENGTH,
    worker_pb2.ABORT: FinishReason.ABORT,
}


@dataclass(frozen=True, slots=True)
class WorkerChunk:
    token_ids: Sequence[int]
    finish_reason: FinishReason | None = None
    # On the last chunk (from the worker's Usage):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


def to_pb_sampling(sp: SamplingParams) -> worker_pb2.SamplingParams:
    msg = worker_pb2.SamplingParams(
        temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p, max_tokens=sp.max_tokens,
        stop_token_ids=sp.stop_token_ids, ignore_eos=sp.ignore_eos,
        seed_step_offset=sp.seed_step_offset,
    )
    if sp.seed is not None:
        msg.seed = sp.seed
    return msg


class DecodeWorkerClient:
    def __init__(self, pool: ChannelPool) -> None:
        self._pool = pool

    async def generate(
        self, address: str, request_id: str, token_ids: Sequence[int], sampling: SamplingParams,
        overlap_blocks: int = 0,
    ) -> AsyncIterator[WorkerChunk]:
        """Stream the worker's chunks until the one with a finish reason. Raises
        InvalidRequest (worker said INVALID_ARGUMENT), Unavailable (worker unreachable,
        shutting down or full) or ProcessorError."""
        stub = self._pool.stub(address, worker_pb2_grpc.DecodeWorkerStub)
        call = stub.Generate(worker_pb2.GenerateRequest(
            request_id=request_id, token_ids=token_ids, sampling=to_pb_sampling(sampling),
            router_overlap_blocks=overlap_blocks,
        ))
        try:
            async for msg in call:
                reason = _FINISH.get(msg.finish_reason)
                if reason is None:
                    yield WorkerChunk(msg.token_ids)
                    continue
                u = msg.usage
                yield WorkerChunk(msg.token_ids, reason, u.prompt_tokens, u.completion_tokens,
                                  u.cached_tokens)
                return
        except grpc.aio.AioRpcError as e:
            raise _translate(address, e) from None
        finally:
            call.cancel()  # no-op once the call is done; aborts the request otherwise


def _translate(address: str, e: grpc.aio.AioRpcError) -> ProcessorError:
    code, details = e.code(), e.details() or e.code().name
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidRequest(details)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return Overloaded(f"decode worker {address}: {details}", code="overloaded")
    if code == grpc.StatusCode.UNAVAILABLE:
        return Unavailable(f"decode worker {address}: {details}")
    return ProcessorError(f"decode worker {address} failed: {code.name}: {details}")
