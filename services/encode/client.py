"""An encode worker over gRPC as the language side's EncodeChannel."""

from __future__ import annotations

import grpc

from services.api.embedding import TransferChunk, TransferRequest
from services.api.embedding_codec import ask_to_pb, chunk_from_pb
from services.common.address_book import AddressBook
from services.common.grpc_auth import call_metadata
from services.engine.multimodal.blocks import BlocksExhaustedError
from services.gen import encode_pb2, encode_pb2_grpc

# An image is at most multimodal.max_image_bytes (10 MiB by default) plus a small header.
MAX_MESSAGE_BYTES = 64 << 20
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]


class GrpcEncodeChannel:
    """Errors as the receiver expects them: ConnectionError (unreachable, crashed, cut off),
    ValueError (a bad ask or chunk), BlocksExhaustedError (its buffer is full)."""

    def __init__(self, address: str, stub: encode_pb2_grpc.EncodeWorkerStub, name: str | None = None) -> None:
        self.address, self._stub_ = address, stub
        self.name = name or address

    def _stub(self) -> encode_pb2_grpc.EncodeWorkerStub:
        return self._stub_

    async def transfer(self, req: TransferRequest) -> TransferChunk:
        try:
            reply = await self._stub().Transfer(ask_to_pb(req), metadata=call_metadata())
        except grpc.aio.AioRpcError as e:
            raise _error(e, self.name) from None
        return chunk_from_pb(reply)

    async def abort(self, req_id: str) -> None:
        try:
            await self._stub().Abort(encode_pb2.AbortTransferRequest(transfer_id=req_id),
                                     metadata=call_metadata(), timeout=1.0)
        except grpc.aio.AioRpcError as e:
            raise _error(e, self.name) from None


class EncodeDirectory:
    """The encode workers discovery lists, as channels in the order a request tries them
    (rotated per call, so requests spread over the workers). Owns their gRPC channels
    (with message limits an image and a chunk fit)."""

    def __init__(self, book: AddressBook) -> None:
        self.book = book
        self._channels: dict[str, tuple[grpc.aio.Channel, GrpcEncodeChannel]] = {}
        self._rr = 0

    def channels(self) -> list[GrpcEncodeChannel]:
        regs = sorted((r.address, r.instance_id) for r in self.book.instances.values() if r.address)
        out = []
        for address, name in regs:
            held = self._channels.get(address)
            if held is None:
                ch = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
                held = self._channels[address] = (ch, GrpcEncodeChannel(address, encode_pb2_grpc.EncodeWorkerStub(ch),
                                                                        name))
            out.append(held[1])
        if out:
            self._rr = (self._rr + 1) % len(out)
            out = out[self._rr:] + out[: self._rr]
        return out

    async def close(self) -> None:
        held, self._channels = list(self._channels.values()), {}
        for ch, _ in held:
            await ch.close()


def _error(e: grpc.aio.AioRpcError, name: str) -> Exception:
    code = e.code()
    msg = f"encode worker {name}: {code.name}: {e.details()}"
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return ValueError(msg)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return BlocksExhaustedError(msg)
    return ConnectionError(msg)
