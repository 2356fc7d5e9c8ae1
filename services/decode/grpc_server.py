"""gRPC adapter of the decode worker (proto/worker.proto): codec and error table only."""

from __future__ import annotations

from contextlib import aclosing

import grpc

from services.api.worker_codec import generate_request_from_pb, move_source_to_pb, output_to_pb
from services.common.errors import RequestMoved, ServingError, abort, decode_or_abort
from services.common.grpc_server import serve_grpc
from services.decode.move_out import MoveNotHeld, MoveTokenRefused
from services.decode.worker import DecodeWorker
from services.engine.move import MoveRefused
from services.engine.request import GenerateRequest
from services.gen import worker_pb2, worker_pb2_grpc


class DecodeWorkerServicer(worker_pb2_grpc.DecodeWorkerServicer):
    """``Generate`` -> ``DecodeWorker.generate``; ``KvTransfer`` -> its ``KvReceiver``;
    ``MoveKv`` -> its ``MoveOutbox``.

    A cancelled Generate call cancels the handler task, which closes the worker's iterator
    and so aborts the request in the engine. A request moved off (RequestMoved) ends its
    stream with status OK and a last message carrying ``moved``.
    """

    def __init__(self, worker: DecodeWorker) -> None:
        self._worker = worker

    async def Generate(self, request: worker_pb2.GenerateRequest,  # noqa: N802
                       context: grpc.aio.ServicerContext):
        wreq = await decode_or_abort(context, generate_request_from_pb, request)
        req, images = GenerateRequest(wreq.request_id, wreq.prompt_token_ids, wreq.sampling), wreq.images
        produced = 0
        try:
            async with aclosing(self._worker.generate(req, images, wreq.move_from)) as outs:
                async for o in outs:
                    produced += len(o.token_ids)
                    yield output_to_pb(o, produced)
        except RequestMoved as e:
            msg = worker_pb2.GenerateResponse()
            msg.moved.SetInParent()  # empty: handed back, nothing kept
            if e.source is not None:
                msg.moved.CopyFrom(move_source_to_pb(e.source))
            yield msg
        except ServingError as e:  # InvalidRequestError, Overloaded, Unavailable, EngineDeadError
            await abort(context, e)

    async def KvTransfer(self, request_iterator, context: grpc.aio.ServicerContext):  # noqa: N802
        return await self._worker.receiver.receive(aiter(request_iterator))

    async def MoveKv(self, request: worker_pb2.MoveKvRequest,  # noqa: N802
                     context: grpc.aio.ServicerContext):
        chunks = self._worker.outbox.pull(request)
        try:
            async for chunk in chunks:
                yield chunk
        except MoveNotHeld as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, e.args[0])
        except MoveTokenRefused as e:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))
        except MoveRefused as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        finally:
            await chunks.aclose()  # a cancelled call frees the held request too


# KvTransfer messages carry up to prefill.kv_chunk_bytes of payload plus a small header.
MAX_KV_MESSAGE_BYTES = (16 << 20) + (64 << 10)
SERVER_OPTIONS = [("grpc.max_receive_message_length", MAX_KV_MESSAGE_BYTES)]


def add_decode_servicer(servicer: DecodeWorkerServicer, server: grpc.aio.Server) -> None:
    """Like the generated ``add_DecodeWorkerServicer_to_server``, except that ``KvTransfer``
    receives each KvChunk as its serialized bytes (``KvReceiver`` slices the payload out
    itself: one copy fewer than protobuf parsing it into a new ``bytes``), and ``MoveKv``
    sends them so."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, request_deserializer=worker_pb2.GenerateRequest.FromString,
            response_serializer=worker_pb2.GenerateResponse.SerializeToString),
        "KvTransfer": grpc.stream_unary_rpc_method_handler(
            servicer.KvTransfer, request_deserializer=None,
            response_serializer=worker_pb2.KvTransferAck.SerializeToString),
        # NOTE: MoveKv streams KvChunks serialized already (kv_wire.kv_chunks).
        "MoveKv": grpc.unary_stream_rpc_method_handler(
            servicer.MoveKv, request_deserializer=worker_pb2.MoveKvRequest.FromString,
            response_serializer=None),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("tandem.worker.DecodeWorker", handlers),))


async def serve_decode_worker(worker: DecodeWorker, host: str, port: int
                              ) -> tuple[grpc.aio.Server, int]:
    """Serve ``worker`` on host:port (0 = any free port); returns the server and bound port."""
    return await serve_grpc("decode worker", host, port,
                            lambda s: add_decode_servicer(DecodeWorkerServicer(worker), s),
                            options=SERVER_OPTIONS)
