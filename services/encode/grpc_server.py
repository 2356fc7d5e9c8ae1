"""gRPC adapter of the encode worker (proto/encode.proto): codec and error table only."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from services.api.embedding_codec import ask_from_pb, chunk_to_wire
from services.common.errors import decode_or_abort
from services.common.grpc_server import serve_grpc
from services.encode.client import MAX_MESSAGE_BYTES
from services.engine.multimodal.blocks import BlocksExhaustedError
from services.engine.multimodal.embedder import LocalEncodeChannel
from services.gen import encode_pb2


class EncodeWorkerServicer:
    def __init__(self, channel: LocalEncodeChannel) -> None:
        self._channel = channel

    async def Transfer(self, request: encode_pb2.EmbeddingTransferRequest,  # noqa: N802
                       context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        """The serialized EmbeddingChunk pieces (embedding_codec.chunk_to_wire: rows copied once)."""
        ask = await decode_or_abort(context, ask_from_pb, request)
        try:
            chunk = await self._channel.transfer(ask)
        except BlocksExhaustedError as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except ValueError as e:  # a bad offset, or an image the vision model cannot read
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        for piece in chunk_to_wire(chunk):
            yield piece

    async def Abort(self, request: encode_pb2.AbortTransferRequest,  # noqa: N802
                    context: grpc.aio.ServicerContext) -> encode_pb2.AbortTransferReply:
        await self._channel.abort(request.transfer_id)
        return encode_pb2.AbortTransferReply()


def add_encode_servicer(servicer: EncodeWorkerServicer, server: grpc.aio.Server) -> None:
    """Like the generated ``add_EncodeWorkerServicer_to_server``, except that ``Transfer``
    streams EmbeddingChunk pieces serialized already (their rows joined in once)."""
    handlers = {
        "Transfer": grpc.unary_stream_rpc_method_handler(
            servicer.Transfer, request_deserializer=encode_pb2.EmbeddingTransferRequest.FromString,
            response_serializer=None),
        "Abort": grpc.unary_unary_rpc_method_handler(
            servicer.Abort, request_deserializer=encode_pb2.AbortTransferRequest.FromString,
            response_serializer=encode_pb2.AbortTransferReply.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("tandem.encode.EncodeWorker", handlers),))


async def serve_encode_worker(channel: LocalEncodeChannel, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    """Serve on host:port (0 = any free port); returns the server and the bound port."""
    opts = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
    return await serve_grpc("encode worker", host, port,
                            lambda s: add_encode_servicer(EncodeWorkerServicer(channel), s), options=opts)
