"""The decode worker's ``Generate`` stream over gRPC (proto/worker.proto), as the engine's
``TokenOutput``s.

Closing the iterator before every choice finished (break + aclose, or the consuming task
cancelled) cancels the gRPC call, which aborts the request on the worker; once they all
finished the call is left to end with the worker's status (services/common/grpc_stream.py).
"""

from __future__ import annotations

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
from services.common.grpc_stream import close_stream
from services.gen import worker_pb2_grpc


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
            await close_stream(call, ended)

