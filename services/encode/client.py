"""An encode worker over gRPC as the language side's EncodeChannel.

On one host (equal ``kv_shm.host_id()``) each ask offers a reusable /dev/shm segment of
this side's pool (services/disagg/shm_pool.py) for the rows: the encode worker writes them
there and answers with the header only. The rows stay where they landed: the chunk's tensor
is the segment's payload (``Segment.lend``; the one copy in all), and the segment is free for
the next ask once the last reference to that tensor is gone (a whole image's: when the
engine is done with the image; a resumed chunk's: once the receiver copied it out). The
segment's name is unlinked once the call ended, whatever the outcome; a segment whose call
failed or was cancelled is dropped
(the encode worker may still be writing it). An encode worker that answers with bytes
instead (another host, a private /dev/shm) is not offered segments again; one that lost
its mapping of a segment it used before (restarted, evicted) is offered fresh ones."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import AsyncIterator

import grpc

from services.api.embedding import ShmTarget, TransferChunk, TransferRequest
from services.api.embedding_codec import (
    ask_to_pb,
    bytes_view,
    chunk_from_rows,
    chunk_layout,
    split_chunk,
)
from services.common.address_book import AddressBook
from services.common.grpc_auth import call_metadata
from services.disagg.byte_buffers import ByteBufferPool
from services.disagg.kv_shm import ShmUnavailableError, host_id, new_segment_name, unlink_segment
from services.disagg.shm_pool import HEADER_BYTES, Segment, SegmentPool
from services.engine.multimodal.blocks import BlocksExhaustedError
from services.gen import encode_pb2

# An image is at most multimodal.max_image_bytes (10 MiB by default) plus a small header.
MAX_MESSAGE_BYTES = 64 << 20
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
_SERVICE = "/tandem.encode.EncodeWorker/"


class GrpcEncodeChannel:
    """Errors as the receiver expects them: ConnectionError (unreachable, crashed, cut off),
    ValueError (a bad ask or chunk), BlocksExhaustedError (its buffer is full).
    ``shm_pool_bytes``: the segments this side offers (0: bytes only). Use from one event loop."""

    def __init__(self, address: str, channel: grpc.aio.Channel, name: str | None = None,
                 shm_pool_bytes: int = 0) -> None:
        self.address = address
        self.name = name or address
        # NOTE: the reply is taken raw: chunk_from_wire views the rows in it, no protobuf copy.
        self._transfer = channel.unary_stream(
            _SERVICE + "Transfer", request_serializer=encode_pb2.EmbeddingTransferRequest.SerializeToString,
            response_deserializer=None)
        self._abort = channel.unary_unary(
            _SERVICE + "Abort", request_serializer=encode_pb2.AbortTransferRequest.SerializeToString,
            response_deserializer=encode_pb2.AbortTransferReply.FromString)
        self.host = host_id()
        self.segments = SegmentPool(shm_pool_bytes if self.host else 0, lambda: new_segment_name("mm"))
        self.shm_declined = False  # the encode worker answered a fresh segment with bytes
        self.buffers = ByteBufferPool(256 << 20)  # chunks that came in several pieces

    async def transfer(self, req: TransferRequest) -> TransferChunk:
        seg = self._segment(req)
        if seg is not None:
            req = dataclasses.replace(req, shm=ShmTarget(self.host, seg.name, HEADER_BYTES, seg.size))
        done = False
        try:
            chunk = await self._receive(self._transfer(ask_to_pb(req), metadata=call_metadata()), seg)
            done = True
        except grpc.aio.AioRpcError as e:
            raise _error(e, self.name) from None
        finally:
            if seg is not None:
                unlink_segment(seg.name)
                if not done:  # failed or cancelled: the encode worker may still write it
                    self.segments.drop(seg)
        if seg is None:
            return chunk
        if not chunk.placed:
            if seg.fresh:  # it cannot map our segments at all: bytes from now on
                self.shm_declined = True
                self.segments.drop(seg)
            else:  # it lost its mappings (restarted, evicted them): fresh segments next time
                self.segments.forget(self.address)
            return chunk
        seg.fresh = False  # mapped there: the next ask may name it again (once the rows are freed)
        if not seg.pooled:
            self.segments.drop(seg)  # past the pool's bytes: the rows keep its mapping alive
        return chunk

    async def _receive(self, call: grpc.aio.UnaryStreamCall, seg: Segment | None) -> TransferChunk:
        try:
            return await self._assemble(aiter(call), seg)
        finally:
            call.cancel()  # a no-op once the answer ended; frees the call on an error

    async def _assemble(self, pieces: AsyncIterator[bytes], seg: Segment | None) -> TransferChunk:
        """The chunk of one answer: header-only (rows in ``seg``, lent), one message (rows
        viewed in it), or several (rows copied once, in order, into a pooled buffer)."""
        first = await anext(pieces, None)
        if first is None:
            raise ValueError("empty answer")
        head, data = split_chunk(first)
        _, nbytes = chunk_layout(head)
        if head.in_shm:
            if seg is None or len(data) or nbytes > seg.capacity:
                raise ValueError("chunk placed in a shared-memory segment this ask did not offer")
            # NOTE: the rows are whole once the header is here (written before it was sent):
            # the call's end is not awaited (a read more: a tenth of a small transfer's time).
            return dataclasses.replace(chunk_from_rows(head, seg.lend(nbytes)), owned=True)
        nxt = await anext(pieces, None)
        if nxt is None and head.byte_offset == 0:
            if len(data) != nbytes:
                raise ValueError(f"chunk of {len(data)} bytes is not {head.rows}x{head.hidden} {head.dtype}")
            return chunk_from_rows(head, bytes_view(data))
        # NOTE: a whole image in one chunk lands in a lent buffer, which the receiver keeps
        # as the image's tensor (no second copy) and which returns to the pool with its
        # last view (a fresh one faulted in every page: a sixth of the receiving CPU);
        # parts of one go through a taken buffer.
        whole = head.offset == 0 and head.is_last
        buf = self.buffers.lend(nbytes) if whole else self.buffers.take(nbytes)
        try:
            mv = memoryview(buf.numpy())
            pos, off = 0, head.byte_offset
            while True:
                if off != pos or pos + len(data) > nbytes:
                    raise ValueError(f"chunk piece at byte {off} (+{len(data)}); expected {pos} of {nbytes}")
                mv[pos:pos + len(data)] = data
                pos += len(data)
                if nxt is None:
                    break
                piece, data = split_chunk(nxt)
                off = piece.byte_offset
                nxt = await anext(pieces, None)
            if pos != nbytes:
                raise ValueError(f"chunk ended at byte {pos} of {nbytes}")
        except BaseException:
            if not whole:
                self.buffers.give(buf)
            raise
        if whole:
            return dataclasses.replace(chunk_from_rows(head, buf), owned=True)
        return dataclasses.replace(chunk_from_rows(head, buf), release=functools.partial(self.buffers.give, buf))

    def _segment(self, req: TransferRequest) -> Segment | None:
        if self.shm_declined or req.row_bytes <= 0:
            return None
        try:
            return self.segments.take(self.address, req.capacity_tokens * req.row_bytes)
        except ShmUnavailableError:
            return None

    async def abort(self, req_id: str) -> None:
        try:
            await self._abort(encode_pb2.AbortTransferRequest(transfer_id=req_id),
                              metadata=call_metadata(), timeout=1.0)
        except grpc.aio.AioRpcError as e:
            raise _error(e, self.name) from None

    def close(self) -> None:
        self.segments.close()


class EncodeDirectory:
    """The encode workers discovery lists, as channels in the order a request tries them
    (rotated per call, so requests spread over the workers). Owns their gRPC channels
    (with message limits an image and a chunk fit)."""

    def __init__(self, book: AddressBook, shm_pool_bytes: int = 0) -> None:
        self.book = book
        self.shm_pool_bytes = shm_pool_bytes
        self._channels: dict[str, tuple[grpc.aio.Channel, GrpcEncodeChannel]] = {}
        self._rr = 0

    def channels(self) -> list[GrpcEncodeChannel]:
        regs = sorted((r.address, r.instance_id) for r in self.book.instances.values() if r.address)
        out = []
        for address, name in regs:
            held = self._channels.get(address)
            if held is None:
                ch = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
                held = self._channels[address] = (ch, GrpcEncodeChannel(address, ch, name, self.shm_pool_bytes))
            out.append(held[1])
        if out:
            self._rr = (self._rr + 1) % len(out)
            out = out[self._rr:] + out[: self._rr]
        return out

    async def close(self) -> None:
        held, self._channels = list(self._channels.values()), {}
        for ch, enc in held:
            enc.close()
            await ch.close()


def _error(e: grpc.aio.AioRpcError, name: str) -> Exception:
    code = e.code()
    msg = f"encode worker {name}: {code.name}: {e.details()}"
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return ValueError(msg)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return BlocksExhaustedError(msg)
    return ConnectionError(msg)
