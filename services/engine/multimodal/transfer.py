"""The image-embedding transfer between an encode side and a language side.

Language side (``EmbeddingReceiver.fetch``): ``alloc_default()`` a buffer, ask the encode
side for the image; the reply carries the first ``min(capacity, true length)`` rows and the
true length (aux). While rows remain it keeps what it got, frees, allocates the remainder
(or, when the buffer has no run that long, as much as it has: several resumes) and resumes
with ``sent_tokens``; each chunk's rows are copied once, straight into the image's tensor
(a whole image in memory of its own, a gRPC answer's buffer or a lent shared-memory
segment, is kept as that tensor: no copy at all). If an encode side fails or times out, the
request resumes from ``sent_tokens`` on the next one (which encodes the image and skips what
was already received), or fails with ``EncodeFailedError``.

Encode side (``EmbeddingSender``): encodes, ``alloc``s by true length, sends from the offset
asked (rows in the model's dtype; written straight into the ask's shared-memory target when
it has one this host can use: ``placer.py``), frees when the last row is sent, on ``abort``, or when the language side went quiet
for ``stale_after_s`` (``reap``). Every block on both sides is freed on every path.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from services.api.embedding import TransferChunk, TransferRequest
from services.engine.multimodal.blocks import (
    BlockAllocation,
    BlocksExhaustedError,
    EmbeddingBlockAllocator,
)
from services.engine.multimodal.buffers import EmbeddingBuffers
from services.engine.multimodal.placer import ShmPlacer


class EncodeChannel(Protocol):
    """One encode worker as the language side sees it (in process, or over gRPC)."""

    name: str

    async def transfer(self, req: TransferRequest) -> TransferChunk: ...

    async def abort(self, req_id: str) -> None: ...


class EncodeFailedError(RuntimeError):
    """No encode worker produced the image's embeddings (each failed or timed out)."""


class ReceiveBuffersFullError(RuntimeError):
    """This side's embedding buffer has no free block now (retry later)."""


@dataclass(slots=True)
class _Transfer:
    allocation: BlockAllocation
    embeds: torch.Tensor  # (total, hidden): the encoder's output, never written (chunks view it)
    image_hash: str
    touched: float = field(default=0.0)

    @property
    def total(self) -> int:
        return int(self.embeds.shape[0])


class EmbeddingSender:
    """The encode side of the protocol. Its blocks bound the rows it holds for transfers;
    the rows themselves stay in the encoder's output (in ``buffers``' dtype), which chunks
    view: copying them into a block buffer first would be one more copy of every row."""

    def __init__(self, allocator: EmbeddingBlockAllocator, buffers: EmbeddingBuffers,
                 encode: Callable[[str, bytes], torch.Tensor], clock: Callable[[], float] = time.monotonic,
                 placer: ShmPlacer | None = None) -> None:
        self.allocator, self.buffers, self._encode, self._clock = allocator, buffers, encode, clock
        self.placer = placer
        self._transfers: dict[str, _Transfer] = {}

    def transfer(self, req: TransferRequest) -> TransferChunk:
        if req.capacity_tokens <= 0:
            raise ValueError(f"{req.req_id}: capacity_tokens must be positive")
        t = self._transfers.get(req.req_id)
        if t is not None and t.image_hash != req.image_hash:  # an id reused for another image
            self._drop(req.req_id)
            t = None
        if t is None:
            embeds = self._encode(req.image_hash, req.image)  # (true length, hidden)
            if embeds.dim() != 2 or embeds.shape[1] != self.buffers.rows.shape[1]:
                raise ValueError(f"{req.req_id}: the encoder gave rows of shape {tuple(embeds.shape)}")
            allocation = self.allocator.alloc(embeds.shape[0], req.req_id)
            rows = embeds.detach().to("cpu", self.buffers.rows.dtype).contiguous()  # no copy when already so
            t = self._transfers[req.req_id] = _Transfer(allocation, rows, req.image_hash)
        t.touched = self._clock()
        if not 0 <= req.sent_tokens < t.total:
            self._drop(req.req_id)
            raise ValueError(f"{req.req_id}: sent_tokens {req.sent_tokens} outside 0..{t.total - 1}")
        n = min(req.capacity_tokens, t.total - req.sent_tokens)
        total = t.total
        rows = t.embeds[req.sent_tokens : req.sent_tokens + n]
        placed = None
        if req.shm is not None and self.placer is not None:
            placed = self.placer.place(req.shm, rows)
        if placed is not None:
            rows = placed
        last = req.sent_tokens + n == total
        if last:
            self._drop(req.req_id)
        return TransferChunk(rows, total, req.sent_tokens, last, placed is not None)

    def abort(self, req_id: str) -> None:
        self._drop(req_id)

    def reap(self, stale_after_s: float) -> list[str]:
        """Free the transfers no resume touched for ``stale_after_s``; returns their ids."""
        cutoff = self._clock() - stale_after_s
        stale = [rid for rid, t in self._transfers.items() if t.touched < cutoff]
        for rid in stale:
            self._drop(rid)
        return stale

    @property
    def in_flight(self) -> int:
        return len(self._transfers)

    def _drop(self, req_id: str) -> None:
        t = self._transfers.pop(req_id, None)
        if t is not None:
            self.allocator.free(t.allocation, req_id)


class EmbeddingReceiver:
    """The language side of the protocol over its own block buffer."""

    def __init__(self, allocator: EmbeddingBlockAllocator, buffers: EmbeddingBuffers, timeout_s: float = 30.0) -> None:
        """``buffers``: its row width and dtype are the embeddings' here (rows arrive
        straight in each image's own tensor)."""
        self.allocator, self.buffers, self.timeout_s = allocator, buffers, timeout_s

    async def fetch(self, req_id: str, image_hash: str, image: bytes,
                    channels: Sequence[EncodeChannel]) -> torch.Tensor:
        """The image's embeddings (true length, hidden), from the first channel that
        finishes, resuming on the next one after a failure. Raises EncodeFailedError."""
        hidden, dtype = self.buffers.rows.shape[1], self.buffers.rows.dtype
        row_bytes = hidden * self.buffers.rows.element_size()
        out: torch.Tensor | None = None  # (total, hidden): allocated at the first reply
        received, total = 0, None
        errors: list[str] = []
        for channel in channels:
            try:
                while True:
                    try:
                        allocation = (self.allocator.alloc_default(req_id) if total is None
                                      else self.allocator.alloc_up_to(total - received, req_id))
                    except BlocksExhaustedError as e:
                        if received:
                            await _abort_quietly(channel, req_id)
                        raise ReceiveBuffersFullError(str(e)) from None
                    try:
                        ask = TransferRequest(req_id, image_hash, image, received, allocation.num_tokens, row_bytes)
                        async with asyncio.timeout(self.timeout_s):  # NOTE: no task per ask, unlike wait_for
                            reply = await channel.transfer(ask)
                        try:
                            n = _check_reply(reply, ask, total, hidden)
                            if reply.owned and n == reply.total_tokens and reply.embeds.dtype == dtype:
                                out = reply.embeds  # the whole image, in memory of its own
                            else:
                                if out is None:
                                    out = torch.empty(reply.total_tokens, hidden, dtype=dtype)
                                out[received:received + n].copy_(reply.embeds)  # the one copy out
                        finally:
                            reply.release()
                        total, last = reply.total_tokens, reply.is_last
                        del reply  # NOTE: a lent segment is free for the next ask once its rows are gone
                    finally:
                        self.allocator.free(allocation, req_id)
                    received += n
                    if last:
                        if received != total or out is None:
                            raise ValueError(f"last chunk at {received} of {total} rows")
                        return out
            except asyncio.CancelledError:
                await _abort_quietly(channel, req_id)
                raise
            except (ConnectionError, TimeoutError, OSError, ValueError, BlocksExhaustedError) as e:
                # NOTE: a BlocksExhaustedError here is the encode side's (its buffer is full);
                # this side's own is ReceiveBuffersFullError, which ends the fetch.
                errors.append(f"{channel.name}: {type(e).__name__}: {e}")
                await _abort_quietly(channel, req_id)
        raise EncodeFailedError(f"image {image_hash[:12]}: no encode worker finished ({'; '.join(errors) or 'none'})")


def _check_reply(reply: TransferChunk, ask: TransferRequest, total: int | None, hidden: int) -> int:
    if reply.embeds.dim() != 2 or reply.embeds.shape[1] != hidden:
        raise ValueError(f"chunk of shape {tuple(reply.embeds.shape)}; this model's rows have {hidden} values "
                         f"(an encode worker serving another model?)")
    n = int(reply.embeds.shape[0])
    if reply.offset != ask.sent_tokens:
        raise ValueError(f"chunk offset {reply.offset}, expected {ask.sent_tokens}")
    if n <= 0 or n > ask.capacity_tokens:
        raise ValueError(f"chunk of {n} rows for a buffer of {ask.capacity_tokens}")
    if total is not None and reply.total_tokens != total:
        raise ValueError(f"true length changed from {total} to {reply.total_tokens}")
    if ask.sent_tokens + n > reply.total_tokens or reply.is_last != (ask.sent_tokens + n == reply.total_tokens):
        raise ValueError(f"chunk {ask.sent_tokens}+{n} inconsistent with length {reply.total_tokens}")
    return n


async def _abort_quietly(channel: EncodeChannel, req_id: str) -> None:
    """Tell the encode side to free its blocks; it may be gone (then its reaper frees them)."""
    try:
        await asyncio.wait_for(asyncio.shield(channel.abort(req_id)), 1.0)
    except (ConnectionError, TimeoutError, OSError, asyncio.CancelledError):
        pass
