"""The decode worker's ``Generate`` stream over gRPC (proto/worker.proto), as the engine's
``TokenOutput``s.

Closing the iterator (break + aclose, or the consuming task cancelled) cancels the gRPC
call, which aborts the request on the worker.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import grpc

from services.api.images import PromptImage
from services.api.move import MoveSource
from services.api.outputs import FinishReason, TokenOutput
from services.api.sampling import SamplingParams
from services.api.worker_codec import generate_request_to_pb, move_source_from_pb, output_from_pb
from services.common.address_book import ChannelPool
from services.common.errors import RequestMoved, from_rpc_error
from services.common.grpc_auth import call_metadata
from services.gen import worker_pb2_grpc

# A finished call's trailing status follows its last message at once; past this the
# worker is stuck, and the call is cancelled rather than held.
_STATUS_WAIT_S = 2.0


class DecodeWorkerClient:
    def __init__(self, pool: ChannelPool) -> None:
        self._pool = pool

    async def generate(self, address: str, request_id: str, token_ids: Sequence[int],
                       sampling: SamplingParams, images: tuple[PromptImage, ...] = (),
                       move_from: MoveSource | None = None) -> AsyncIterator[TokenOutput]:
        """Stream the worker's outputs until every choice (``sampling.n``) finished, or one
        was aborted. Raises the worker's typed error (services/common/errors.py):
        InvalidRequest, Overloaded, Unavailable (also when it cannot be reached) or
        ServingError; RequestMoved when the worker drained and moved the request off."""
        stub = self._pool.stub(address, worker_pb2_grpc.DecodeWorkerStub)
        call = stub.Generate(generate_request_to_pb(request_id, token_ids, sampling, images, move_from),
                             metadata=call_metadata())
        left = sampling.n
        ended = False  # every choice finished: the worker is closing the call
        try:
            async for msg in call:
                if msg.HasField("moved"):
                    raise RequestMoved(f"decode worker {address} is draining",
                                       move_source_from_pb(msg.moved))
                out = output_from_pb(request_id, msg)
                if out.finished:
                    left -= 1
                    ended = left == 0
                yield out
                if ended or out.finish_reason is FinishReason.ABORT:
                    return
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e, f"decode worker {address}", name_peer=True) from None
        finally:
            await _close(call, ended)


async def _close(call: grpc.aio.UnaryStreamCall, ended: bool) -> None:
    """Cancel a call still producing (that aborts the request on the worker). One whose
    worker is done gets its status awaited instead: a cancel racing the worker's trailing
    status makes its server log an ExecuteBatchError for a request that went fine."""
    try:
        if ended:
            async with asyncio.timeout(_STATUS_WAIT_S):
                await call.code()
    except TimeoutError:
        pass
    finally:
        call.cancel()  # no-op once the call is done
