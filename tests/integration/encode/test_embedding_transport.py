"""Image embeddings between a real encode worker servicer and GrpcEncodeChannel, as gRPC
bytes (streamed pieces) and through the language side's reusable /dev/shm segments:
bit-exact in float32 and bfloat16 with and without resumes, an image's tensor that is its
segment (busy while the tensor lives, reused after), a resume after a broken stream
on another encode worker, no segment left in /dev/shm after success, failure or cancel, and
an encode worker that cannot see the segment answering with bytes."""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
import pytest
import torch

from services.api.embedding_codec import PIECE_BYTES
from services.disagg import kv_shm
from services.disagg.shm_pool import MappedSegments
from services.encode import client
from services.encode.client import CHANNEL_OPTIONS, GrpcEncodeChannel
from services.encode.grpc_server import serve_encode_worker
from services.engine.multimodal.blocks import EmbeddingBlockAllocator
from services.engine.multimodal.buffers import EmbeddingBuffers
from services.engine.multimodal.embedder import LocalEncodeChannel
from services.engine.multimodal.placer import ShmPlacer
from services.engine.multimodal.transfer import EmbeddingReceiver, EmbeddingSender

pytestmark = pytest.mark.asyncio

BLOCK, HIDDEN = 16, 1024
ROWS = 300  # 300 x 1024: 1.2 MB in float32, more than one streamed piece (PIECE_BYTES)


def _embeds(image: bytes, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(int(hashlib.sha256(image).hexdigest()[:8], 16))
    return torch.randn(ROWS, HIDDEN, generator=g).to(dtype)


class Hanging(LocalEncodeChannel):
    """``hang_on``: the n-th ask never answers (its worker froze or went away mid-call)."""

    hang_on = 0

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.asks = []
        self.reached = asyncio.Event()

    async def transfer(self, req):
        self.asks.append(req)
        if len(self.asks) == self.hang_on:
            self.reached.set()
            await asyncio.Event().wait()
        return await super().transfer(req)


@asynccontextmanager
async def encode_worker(dtype: torch.dtype, host: str | None = None, pool: int = 64 << 20,
                        name: str = "e0") -> AsyncIterator[tuple[Hanging, GrpcEncodeChannel, grpc.aio.Server]]:
    """An encode worker (fake encoder) on gRPC whose placer sees this host's /dev/shm
    (``host``: another host's id), and a channel to it offering ``pool`` bytes of segments."""
    sender = EmbeddingSender(EmbeddingBlockAllocator(64, BLOCK, 1), EmbeddingBuffers(64, BLOCK, HIDDEN, dtype),
                             lambda _h, image: _embeds(image, dtype), placer=ShmPlacer(64 << 20, host))
    local = Hanging(sender, name)
    server, port = await serve_encode_worker(local, "127.0.0.1", 0)
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS)
    channel = GrpcEncodeChannel(f"127.0.0.1:{port}", ch, name, shm_pool_bytes=pool)
    try:
        yield local, channel, server
    finally:
        channel.close()
        await ch.close()
        await server.stop(grace=0)
        local.close()


@pytest.fixture
def segments(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths of the segments the language side creates during the test."""
    made: list[str] = []

    def recording(kind: str = "kv") -> str:
        name = kv_shm.new_segment_name(kind)
        made.append(os.path.join(kv_shm.SHM_DIR, name))
        return name

    monkeypatch.setattr(client, "new_segment_name", recording)
    return made


def _receiver(dtype: torch.dtype, default_blocks: int, timeout_s: float = 10.0) -> EmbeddingReceiver:
    return EmbeddingReceiver(EmbeddingBlockAllocator(64, BLOCK, default_blocks),
                             EmbeddingBuffers(64, BLOCK, HIDDEN, dtype), timeout_s)


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


async def _fetch(receiver: EmbeddingReceiver, image: bytes, channels, rid: str = "r/0") -> torch.Tensor:
    return await receiver.fetch(rid, hashlib.sha256(image).hexdigest(), image, channels)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pool", [0, 64 << 20], ids=["grpc", "shm"])
@pytest.mark.parametrize("default_blocks", [32, 4], ids=["whole", "resumes"])
async def test_bit_exact_in_the_models_dtype(segments: list[str], dtype, pool, default_blocks) -> None:
    assert ROWS * HIDDEN * 4 > PIECE_BYTES  # the float32 answers without resume stream in pieces
    async with encode_worker(dtype, pool=pool) as (local, channel, _):
        receiver = _receiver(dtype, default_blocks)
        for i in range(2):  # the second fetch writes into the same segments again
            image = f"img{i}".encode()
            got = await _fetch(receiver, image, [channel], f"r/{i}")
            assert got.dtype == dtype and _bits(got) == _bits(_embeds(image, dtype))
            del got  # the engine is done with the image: a segment it lives in is free again
        assert [a.sent_tokens for a in local.asks] == ([0, 0] if default_blocks == 32 else [0, 64, 0, 64])
        assert receiver.allocator.used_blocks == 0 and local.sender.allocator.used_blocks == 0
        assert not channel.shm_declined
        # whole: one segment for both images; resumes: the same segment for every ask
        assert len(segments) == (1 if pool else 0)
        assert not any(os.path.exists(p) for p in segments)


async def test_an_images_segment_is_its_tensor_and_free_once_that_is_gone(segments: list[str]) -> None:
    dtype = torch.float32
    async with encode_worker(dtype) as (_, channel, _):
        receiver = _receiver(dtype, 32)
        a = await _fetch(receiver, b"a", [channel], "r/0")
        (seg,) = channel.segments.segments(channel.address)
        assert seg.busy() and a.data_ptr() == seg.payload(1).data_ptr()  # no copy out: the rows are there
        b = await _fetch(receiver, b"b", [channel], "r/1")  # a is still in use: another segment
        assert len(segments) == 2 and _bits(a) == _bits(_embeds(b"a", dtype))
        del a
        assert not seg.busy()
        c = await _fetch(receiver, b"c", [channel], "r/2")  # reuses a's
        assert len(segments) == 2 and _bits(b) == _bits(_embeds(b"b", dtype))
        assert _bits(c) == _bits(_embeds(b"c", dtype))
        del b, c
        assert not any(s.busy() for s in channel.segments.segments(channel.address))
        assert not any(os.path.exists(p) for p in segments)


async def test_a_segment_past_the_pool_lives_as_long_as_its_image(segments: list[str]) -> None:
    dtype = torch.bfloat16
    async with encode_worker(dtype, pool=1) as (_, channel, _):  # every segment past the pool
        receiver = _receiver(dtype, 32)
        a = await _fetch(receiver, b"a", [channel], "r/0")
        b = await _fetch(receiver, b"b", [channel], "r/1")
        assert channel.segments.segments(channel.address) == [] and len(segments) == 2
        assert not any(os.path.exists(p) for p in segments)  # dropped: mapped here through a and b only
        assert _bits(a) == _bits(_embeds(b"a", dtype)) and _bits(b) == _bits(_embeds(b"b", dtype))


async def test_resume_after_a_broken_stream_on_another_encode_worker(segments: list[str]) -> None:
    dtype = torch.bfloat16
    async with encode_worker(dtype, name="e0") as (dying, ch0, server0), \
            encode_worker(dtype, name="e1") as (spare, ch1, _):
        receiver = _receiver(dtype, 4)  # 64 rows an ask
        dying.hang_on = 2
        image = b"img"
        task = asyncio.create_task(_fetch(receiver, image, [ch0, ch1]))
        await dying.reached.wait()
        await server0.stop(grace=0)  # the worker's process is gone mid-stream
        got = await task
        assert _bits(got) == _bits(_embeds(image, dtype))
        assert [a.sent_tokens for a in spare.asks][0] == 64  # resumed from what e0 had sent
        assert receiver.allocator.used_blocks == 0
        assert not any(os.path.exists(p) for p in segments)
        assert ch0.segments.segments(ch0.address) == []  # the broken call's segment is dropped


async def test_cancelled_fetch_leaves_no_segment(segments: list[str]) -> None:
    async with encode_worker(torch.float32) as (local, channel, _):
        local.hang_on = 2
        receiver = _receiver(torch.float32, 4)
        task = asyncio.create_task(_fetch(receiver, b"img", [channel]))
        await local.reached.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert segments and not any(os.path.exists(p) for p in segments)
        assert receiver.allocator.used_blocks == 0
        # the first chunk's segment was free once copied out, so the hung ask reused it; dropped
        assert channel.segments.segments(channel.address) == []


async def test_failed_fetch_leaves_no_segment(segments: list[str]) -> None:
    async with encode_worker(torch.float32) as (local, channel, server):
        local.hang_on = 2
        receiver = _receiver(torch.float32, 4, timeout_s=0.5)
        with pytest.raises(Exception, match="no encode worker finished"):
            await _fetch(receiver, b"img", [channel])
        assert len(segments) == 1 and not any(os.path.exists(p) for p in segments)
        assert channel.segments.segments(channel.address) == []  # as for a cancel
        await server.stop(grace=0)


async def test_encode_worker_that_cannot_see_the_segment_sends_bytes(segments: list[str]) -> None:
    async with encode_worker(torch.bfloat16, host="another-host") as (_, channel, _):
        receiver = _receiver(torch.bfloat16, 4)
        got = await _fetch(receiver, b"img", [channel])
        assert _bits(got) == _bits(_embeds(b"img", torch.bfloat16))
        assert channel.shm_declined  # not offered again
        got = await _fetch(receiver, b"img", [channel], "r/1")
        assert len(segments) == 1 and not any(os.path.exists(p) for p in segments)


async def test_encode_worker_that_lost_its_mappings_gets_fresh_segments(segments: list[str]) -> None:
    dtype = torch.float32
    async with encode_worker(dtype) as (local, channel, _):
        receiver = _receiver(dtype, 32)
        assert _bits(await _fetch(receiver, b"a", [channel], "r/0")) == _bits(_embeds(b"a", dtype))
        local.sender.placer.mapped = MappedSegments(64 << 20)  # a restarted encode worker
        # the reused segment cannot be mapped there any more: bytes this time, a fresh one next
        assert _bits(await _fetch(receiver, b"b", [channel], "r/1")) == _bits(_embeds(b"b", dtype))
        assert _bits(await _fetch(receiver, b"c", [channel], "r/2")) == _bits(_embeds(b"c", dtype))
        assert not channel.shm_declined and len(segments) == 2
        assert len(local.sender.placer.mapped) == 1
        assert not any(os.path.exists(p) for p in segments)
