"""Decode side of the KV transfer: remote prefills waiting for their KV, keyed by request id.

The decode worker calls ``expect`` before it publishes a remote prefill and awaits the
returned future; the KvTransfer servicer hands each incoming stream to ``receive``, which
checks the header against what was expected (blocks, shape, dtype) and the payload against
the header (contiguous offsets, exact byte count), then resolves the future. A transfer for
a request that is not waiting (never asked for, already delivered, or given up on after a
timeout) is answered ``accepted=False, error="not waiting"``: a duplicate delivery is harmless.

The header must carry the request's transfer token (services/disagg/transfer_token.py),
drawn by the decode worker and sent only in the job: a transfer without it, with another,
or while a transfer holding it is still streaming in is refused before anything is read,
and the request keeps waiting for the real one, so a forger can neither deliver KV nor make
the request fail. The token is used up when its transfer ends with a verdict (accepted, or
bad KV: the wait ends); a transfer cut off midway hands it back for JetStream's redelivery.

A header with ``shm_name`` (same-host transport, services/disagg/kv_shm.py) is the stream's
only message: the KV is the mapped /dev/shm segment, which is unlinked whatever the outcome.
A reusable segment (``shm_offset > 0``, services/disagg/shm_pool.py) stays mapped here by
name for the sender's next transfers, and ``ReceivedKv.release`` clears its busy flag so
the sender may write it again. A segment that cannot be opened here is answered
``"shm unavailable: ..."`` and the request keeps waiting for the sender's resend (a fresh
segment, or gRPC bytes, with the same token).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import torch
from google.protobuf.message import DecodeError

from services.api.outputs import TokenLogprob
from services.api.request_codec import logprob_from_pb
from services.disagg.byte_buffers import ByteBufferPool
from services.disagg.kv_shm import (
    KV_PREFIX,
    SHM_UNAVAILABLE,
    ShmUnavailableError,
    map_segment,
    unlink_segment,
)
from services.disagg.kv_wire import dtype_from_name, split_kv_chunk
from services.disagg.shm_pool import MappedSegments, payload_view, release_flag
from services.disagg.transfer_token import matches, well_formed
from services.gen import worker_pb2

log = logging.getLogger(__name__)

NOT_WAITING = "not waiting"


class KvTransferError(ValueError):
    """A transfer whose header or payload does not match what the decode worker asked for."""


class KvRefusal(enum.StrEnum):
    """Why a KvTransfer was answered ``accepted=false``
    (``tandem_worker_kv_transfers_refused_total{reason}``)."""

    NOT_WAITING = "not_waiting"  # no request of that id waits: never asked, delivered, given up
    NO_TOKEN = "no_token"  # the header carries no transfer token
    BAD_TOKEN = "bad_token"  # not the token drawn for that request
    TOKEN_IN_USE = "token_in_use"  # a transfer holding the token is streaming in right now
    BAD_KV = "bad_kv"  # the right token, but blocks/shape/dtype/bytes wrong: the wait ends
    MALFORMED = "malformed"  # not a KvChunk stream
    SHM_UNAVAILABLE = "shm_unavailable"  # the segment cannot be used here: resent as bytes


@dataclass(frozen=True, slots=True)
class ExpectedKv:
    first_block: int
    num_blocks: int
    shape: tuple[int, ...]  # (layers, 2, num_blocks, block_size, kv_heads, head_dim)
    dtype: torch.dtype
    # The request's one-time transfer token (transfer_token.new_token()); out of repr so it
    # never reaches a log line.
    token: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if not well_formed(self.token):
            raise ValueError("ExpectedKv needs a token from transfer_token.new_token()")


@dataclass(frozen=True, slots=True)
class ReceivedKv:
    kv: torch.Tensor  # ExpectedKv.shape, ExpectedKv.dtype, on the CPU
    first_token: int
    prefill_worker_id: str
    num_bytes: int
    first_logprob: TokenLogprob | None = None  # when the request asked for logprobs
    # Hands ``kv``'s memory back for reuse; call once nothing reads ``kv`` any more
    # (after the engine imported it). Not calling it is safe, only slower.
    release: Callable[[], None] = field(default=lambda: None, repr=False, compare=False)


@dataclass(slots=True, eq=False)
class _Waiting:
    expected: ExpectedKv
    fut: asyncio.Future[ReceivedKv]
    busy: bool = False  # a transfer with the right token is streaming in


class KvReceiver:
    """Pending remote prefills of one decode worker. Use from the event loop thread only."""

    def __init__(self, on_bytes: Callable[[int], None] | None = None,
                 buffers: ByteBufferPool | None = None,
                 on_refused: Callable[[KvRefusal], None] | None = None,
                 segments: MappedSegments | None = None) -> None:
        self._pending: dict[str, _Waiting] = {}
        self._on_bytes = on_bytes
        self._on_refused = on_refused
        self.buffers = buffers or ByteBufferPool()
        self.segments = segments if segments is not None else MappedSegments(2 << 30)

    def expect(self, request_id: str, expected: ExpectedKv) -> asyncio.Future[ReceivedKv]:
        """Register a request as waiting for KV sent with ``expected.token``; its future gets
        the KV or a KvTransferError."""
        if request_id in self._pending:
            raise ValueError(f"request {request_id!r} is already waiting for KV")
        fut: asyncio.Future[ReceivedKv] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = _Waiting(expected, fut)
        return fut

    def cancel(self, request_id: str) -> None:
        """Stop waiting (timeout, abort): later transfers for it are rejected."""
        entry = self._pending.pop(request_id, None)
        if entry is not None and not entry.fut.done():
            entry.fut.cancel()

    def is_waiting(self, request_id: str) -> bool:
        return request_id in self._pending

    @property
    def num_waiting(self) -> int:
        return len(self._pending)

    async def receive(self, chunks: AsyncIterator[worker_pb2.KvChunk | bytes]) -> worker_pb2.KvTransferAck:
        """Consume one KvTransfer stream and answer it (never raises for bad input).

        Chunks are parsed ``KvChunk`` messages or their serialized bytes (the gRPC server
        hands over raw messages so each payload byte is copied once, into the buffer).
        """
        try:
            head, head_data = _parts(await anext(chunks))
        except StopAsyncIteration:
            return self._refuse(KvRefusal.MALFORMED, "empty KV transfer stream")
        except ValueError as e:
            return self._refuse(KvRefusal.MALFORMED, f"malformed KvChunk: {e}")
        if not head.shm_name:
            return await self._receive(head, head_data, chunks)
        try:
            return await self._receive(head, head_data, chunks)
        finally:
            # Every outcome (read, refused, not waiting, cancelled) removes the segment.
            _discard_segment(head.shm_name)

    def _refuse(self, reason: KvRefusal, error: str, got: int = 0) -> worker_pb2.KvTransferAck:
        if self._on_refused is not None:
            self._on_refused(reason)
        return worker_pb2.KvTransferAck(accepted=False, error=error, bytes_received=got)

    async def _receive(self, head: worker_pb2.KvChunk, head_data: bytes | memoryview,
                       chunks: AsyncIterator[worker_pb2.KvChunk | bytes]) -> worker_pb2.KvTransferAck:
        rid = head.request_id
        w = self._pending.get(rid)
        if w is None:
            return self._refuse(KvRefusal.NOT_WAITING, NOT_WAITING)
        # NOTE: before reading a byte of payload, and without touching the wait: whoever
        # lacks the token can neither deliver this request's KV nor end its wait.
        if not head.transfer_token:
            return self._refuse(KvRefusal.NO_TOKEN, f"KV transfer for {rid!r} carries no transfer token")
        if not matches(head.transfer_token, w.expected.token):
            return self._refuse(KvRefusal.BAD_TOKEN, f"KV transfer for {rid!r} has a wrong transfer token")
        if w.busy:
            return self._refuse(KvRefusal.TOKEN_IN_USE, f"KV for {rid!r} is already being received")
        w.busy = True
        try:
            return await self._take(head, head_data, chunks, w)
        finally:
            # NOTE: a stream cut off without a verdict (cancelled call) hands the token back:
            # JetStream redelivers the job and its new transfer must get through.
            w.busy = False

    async def _take(self, head: worker_pb2.KvChunk, head_data: bytes | memoryview,
                    chunks: AsyncIterator[worker_pb2.KvChunk | bytes], w: _Waiting
                    ) -> worker_pb2.KvTransferAck:
        """Read the payload of an authenticated transfer and settle the wait."""
        rid, expected, fut = head.request_id, w.expected, w.fut
        buf: torch.Tensor | None = None
        try:
            nbytes = _check_header(head, expected)
            if head.shm_name:
                # NOTE: no copy here: the tensor is a mapping of the segment's pages (freed
                # with the tensor); the engine's import is the one copy.
                got, kv, release = await _map_shm(head, head_data, chunks, nbytes, self.segments)
                kv = kv.view(expected.dtype).reshape(expected.shape)
            else:
                buf = self.buffers.take(nbytes)
                got = await _read_payload(head, head_data, chunks, memoryview(buf.numpy()), rid)
                kv = buf.view(expected.dtype).reshape(expected.shape)
                release = _once(self.buffers.give, buf)
        except ShmUnavailableError as e:
            # NOTE: the wait goes on: the sender resends the bytes over gRPC.
            if buf is not None:
                self.buffers.give(buf)
            return self._refuse(KvRefusal.SHM_UNAVAILABLE, f"{SHM_UNAVAILABLE}: {e}")
        except (KvTransferError, ValueError) as e:
            if buf is not None:
                self.buffers.give(buf)
            # NOTE: a bad transfer ends the wait (the worker prefills locally); a retry of
            # the same job would most likely be just as bad. It carried the token, so it
            # came from the job's prefill worker, not a forger.
            if self._pending.get(rid) is w:
                del self._pending[rid]
                if not fut.done():
                    fut.set_exception(KvTransferError(str(e)))
            return self._refuse(KvRefusal.BAD_KV, str(e))
        # The wait may have ended (timeout) while the payload streamed in.
        if self._pending.get(rid) is not w or fut.done():
            release()
            return self._refuse(KvRefusal.NOT_WAITING, NOT_WAITING, got)
        del self._pending[rid]  # the token is used up with it
        # NOTE: checked by _check_header.
        first_lp = logprob_from_pb(head.first_logprob) if head.HasField("first_logprob") else None
        fut.set_result(ReceivedKv(kv, head.first_token, head.prefill_worker_id, got, first_lp,
                                  release=release))
        if self._on_bytes is not None:
            self._on_bytes(got)
        return worker_pb2.KvTransferAck(accepted=True, bytes_received=got)


def _check_header(head: worker_pb2.KvChunk, exp: ExpectedKv) -> int:
    """Validate the header; returns the payload's byte count."""
    rid = head.request_id
    if head.first_block != exp.first_block or head.num_blocks != exp.num_blocks:
        raise KvTransferError(
            f"KV for {rid!r} covers blocks [{head.first_block}, +{head.num_blocks}); "
            f"expected [{exp.first_block}, +{exp.num_blocks})")
    shape = tuple(head.shape)
    if shape != exp.shape:
        raise KvTransferError(f"KV for {rid!r} has shape {shape}; expected {exp.shape}")
    dtype = dtype_from_name(head.dtype)
    if dtype != exp.dtype:
        raise KvTransferError(f"KV for {rid!r} has dtype {head.dtype}; expected {exp.dtype}")
    lp = head.first_logprob
    if len(lp.top_ids) != len(lp.top_logprobs) or (
            head.HasField("first_logprob") and lp.token_id != head.first_token):
        raise KvTransferError(f"KV for {rid!r} has a first_logprob that does not match its "
                              "first token or has unpaired top logprobs")
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def _once(give: Callable[[torch.Tensor], None], buf: torch.Tensor) -> Callable[[], None]:
    """``give(buf)`` on the first call only: a second release must not hand the buffer
    out twice."""
    held = [buf]

    def release() -> None:
        if held:
            give(held.pop())
    return release


async def _map_shm(head: worker_pb2.KvChunk, head_data: bytes | memoryview,
                   chunks: AsyncIterator[worker_pb2.KvChunk | bytes], nbytes: int,
                   segments: MappedSegments) -> tuple[int, torch.Tensor, Callable[[], None]]:
    """(bytes, a uint8 tensor over the header's shared-memory segment, its release), which
    must be the stream's only message."""
    if len(head_data) or await anext(chunks, None) is not None:
        raise KvTransferError(f"shared-memory KV transfer for {head.request_id!r} also carries data")
    if not head.shm_name.startswith(KV_PREFIX):  # NOTE: never an embedding segment of this worker's
        raise KvTransferError(f"KV for {head.request_id!r} names a segment that is not a KV one")
    if head.shm_offset == 0:  # a one-shot segment: exactly the payload
        # NOTE: in a thread: faulting in a few hundred MB of pages takes a while.
        mm = await asyncio.to_thread(map_segment, head.shm_name, nbytes)
        return nbytes, torch.frombuffer(mm, dtype=torch.uint8), _noop
    if head.shm_offset + nbytes > head.shm_size:
        raise KvTransferError(f"KV for {head.request_id!r} does not fit its shared-memory segment: "
                              f"{nbytes} bytes from {head.shm_offset} of {head.shm_size}")
    mm = segments.get(head.shm_name)
    if mm is None:
        mm = await asyncio.to_thread(map_segment, head.shm_name, head.shm_size)
        segments.add(head.shm_name, mm)
    elif len(mm) != head.shm_size:
        raise KvTransferError(f"shared-memory segment {head.shm_name} holds {len(mm)} bytes; "
                              f"the header says {head.shm_size}")
    # NOTE: no copy here: the engine's import is the one copy out; release lets the
    # sender write the segment again.
    return nbytes, payload_view(mm, head.shm_offset, nbytes), release_flag(mm)


def _noop() -> None:
    pass


def _discard_segment(name: str) -> None:
    try:
        unlink_segment(name)
    except ValueError:
        pass  # not a name we accept: nothing of ours to remove
    except OSError as e:
        log.warning("cannot remove shared-memory segment %s: %s", name, e)


def _parts(chunk: worker_pb2.KvChunk | bytes) -> tuple[worker_pb2.KvChunk, bytes | memoryview]:
    """(the chunk's fields but data, its data); ValueError for malformed bytes."""
    if isinstance(chunk, worker_pb2.KvChunk):
        return chunk, chunk.data
    rest, data = split_kv_chunk(chunk)
    try:
        return worker_pb2.KvChunk.FromString(rest), data
    except DecodeError as e:  # NOTE: not a ValueError (e.g. a string that is not UTF-8)
        raise ValueError(f"cannot parse KvChunk: {e}") from e


async def _read_payload(head: worker_pb2.KvChunk, head_data: bytes | memoryview,
                        chunks: AsyncIterator[worker_pb2.KvChunk | bytes], mv: memoryview,
                        rid: str) -> int:
    """Copy every chunk's data into ``mv``; offsets must be contiguous and fill it exactly."""
    pos = 0
    chunk: worker_pb2.KvChunk | None = head
    data = head_data
    while chunk is not None:
        if chunk.request_id and chunk.request_id != rid:
            raise KvTransferError(f"KV stream for {rid!r} carries a chunk of {chunk.request_id!r}")
        n = len(data)
        if chunk.offset != pos:
            raise KvTransferError(f"KV chunk for {rid!r} at offset {chunk.offset}; expected {pos}")
        if pos + n > len(mv):
            raise KvTransferError(f"KV for {rid!r} is longer than its shape: > {len(mv)} bytes")
        mv[pos:pos + n] = data
        pos += n
        nxt = await anext(chunks, None)
        chunk, data = (None, b"") if nxt is None else _parts(nxt)
    if pos != len(mv):
        raise KvTransferError(f"KV for {rid!r} ended at {pos} of {len(mv)} bytes")
    return pos
