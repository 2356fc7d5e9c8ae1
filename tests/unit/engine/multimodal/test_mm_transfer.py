"""Seed 002's transfer protocol between an encode side and a language side, in process:
true length below / equal to / above the default buffer, far above it, several images,
an encode side dying before or during a resume, and a cancelled request. After every
scenario both sides hold no blocks."""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.api.embedding import TransferChunk, TransferRequest
from services.engine.multimodal.blocks import EmbeddingBlockAllocator
from services.engine.multimodal.buffers import EmbeddingBuffers
from services.engine.multimodal.transfer import (
    EmbeddingReceiver,
    EmbeddingSender,
    EncodeFailedError,
)

HIDDEN = 4
BLOCK = 16


def _embeds(image: bytes) -> torch.Tensor:
    """A fake encoder: the image names its length; row i holds i and the image's first byte."""
    n = int(image.decode().split(":")[1])
    rows = torch.arange(n, dtype=torch.float32)[:, None].expand(n, HIDDEN).clone()
    return rows + image[0] * 1000


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _sender(num_blocks: int = 128, clock: Clock | None = None) -> EmbeddingSender:
    return EmbeddingSender(EmbeddingBlockAllocator(num_blocks, BLOCK, 1), EmbeddingBuffers(num_blocks, BLOCK, HIDDEN),
                           lambda _hash, image: _embeds(image), clock or Clock())


def _receiver(num_blocks: int = 16, default_blocks: int = 2, timeout_s: float = 5.0) -> EmbeddingReceiver:
    return EmbeddingReceiver(EmbeddingBlockAllocator(num_blocks, BLOCK, default_blocks),
                             EmbeddingBuffers(num_blocks, BLOCK, HIDDEN), timeout_s)


class Channel:
    """An encode worker in process. ``die_on_call=k``: the k-th transfer raises (the worker
    is gone before it answers; ``after_work`` means it did the work first); ``hang_on_call``:
    never answers. A dead worker's abort fails too."""

    def __init__(self, name: str, sender: EmbeddingSender, die_on_call: int = 0, after_work: bool = False,
                 hang_on_call: int = 0) -> None:
        self.name, self.sender = name, sender
        self.die_on_call, self.after_work, self.hang_on_call = die_on_call, after_work, hang_on_call
        self.asks: list[TransferRequest] = []
        self.aborted: list[str] = []
        self.dead = False

    async def transfer(self, req: TransferRequest) -> TransferChunk:
        self.asks.append(req)
        n = len(self.asks)
        if n == self.hang_on_call:
            self.dead = True
            await asyncio.Event().wait()
        if n == self.die_on_call:
            self.dead = True
            if self.after_work:
                self.sender.transfer(req)
            raise ConnectionError("encode worker went away")
        return self.sender.transfer(req)

    async def abort(self, req_id: str) -> None:
        if self.dead:
            raise ConnectionError("encode worker went away")
        self.aborted.append(req_id)
        self.sender.abort(req_id)


def _fetch(receiver, channels, image: bytes, rid: str = "r"):
    return asyncio.run(receiver.fetch(rid, "h" * 64, image, channels))


@pytest.mark.parametrize("length,rounds", [(20, 1), (32, 1), (33, 2), (50, 2)])
def test_true_length_below_equal_above_the_default_buffer(length, rounds):
    receiver, sender = _receiver(default_blocks=2), _sender()  # default buffer: 32 rows
    ch = Channel("e0", sender)
    got = _fetch(receiver, [ch], f"a:{length}".encode())
    assert torch.equal(got, _embeds(f"a:{length}".encode()))
    assert [a.sent_tokens for a in ch.asks] == [0, 32][:rounds]
    assert [a.capacity_tokens for a in ch.asks] == [32, length - 32][:rounds]
    assert receiver.allocator.used_blocks == 0 and sender.allocator.used_blocks == 0
    assert sender.in_flight == 0


def test_far_above_the_buffer_takes_several_resumes():
    receiver, sender = _receiver(num_blocks=4, default_blocks=2), _sender()  # the whole buffer: 64 rows
    ch = Channel("e0", sender)
    image = b"b:300"
    got = _fetch(receiver, [ch], image)
    assert torch.equal(got, _embeds(image))
    assert [a.sent_tokens for a in ch.asks] == [0, 32, 96, 160, 224, 288]
    assert receiver.allocator.used_blocks == 0 and sender.allocator.used_blocks == 0


def test_several_images_in_one_request_share_the_buffers():
    receiver, sender = _receiver(num_blocks=8, default_blocks=2), _sender()
    ch = Channel("e0", sender)
    images = [b"a:40", b"b:7", b"c:130"]

    async def all_images():
        return await asyncio.gather(*(receiver.fetch(f"r-{i}", f"{i:064}", im, [ch]) for i, im in enumerate(images)))

    got = asyncio.run(all_images())
    for g, im in zip(got, images, strict=True):
        assert torch.equal(g, _embeds(im))
    assert receiver.allocator.used_blocks == 0 and sender.allocator.used_blocks == 0


def test_encode_side_dies_before_the_resume_then_another_resumes_from_the_offset():
    clock = Clock()
    a, b = _sender(clock=clock), _sender()
    dying = Channel("e0", a, die_on_call=2)  # answers the first ask, gone at the resume
    spare = Channel("e1", b)
    receiver = _receiver(default_blocks=2)
    got = _fetch(receiver, [dying, spare], b"a:70")
    assert torch.equal(got, _embeds(b"a:70"))
    assert [x.sent_tokens for x in spare.asks] == [32]  # resumed where e0 stopped
    assert receiver.allocator.used_blocks == 0 and b.allocator.used_blocks == 0
    # e0 could not be told to abort: its reaper frees the transfer nobody resumes.
    assert a.allocator.used_blocks > 0
    clock.now = 100.0
    assert a.reap(stale_after_s=30.0) == ["r"]
    assert a.allocator.used_blocks == 0


def test_encode_side_dies_during_the_resume():
    a, b = _sender(), _sender()
    dying = Channel("e0", a, die_on_call=2, after_work=True)
    spare = Channel("e1", b)
    receiver = _receiver(default_blocks=2)
    got = _fetch(receiver, [dying, spare], b"z:200")
    assert torch.equal(got, _embeds(b"z:200"))
    assert receiver.allocator.used_blocks == 0 and b.allocator.used_blocks == 0
    assert a.allocator.used_blocks == 0  # it sent the last rows (and freed) before dying


def test_encode_side_hangs_and_the_receiver_times_out_to_the_next():
    a, b = _sender(), _sender()
    hanging = Channel("e0", a, hang_on_call=2)
    spare = Channel("e1", b)
    receiver = _receiver(default_blocks=2, timeout_s=0.05)
    got = _fetch(receiver, [hanging, spare], b"q:90")
    assert torch.equal(got, _embeds(b"q:90"))
    assert [x.sent_tokens for x in spare.asks] == [32]
    assert receiver.allocator.used_blocks == 0 and b.allocator.used_blocks == 0


def test_every_encode_side_fails_clearly_and_frees_the_language_blocks():
    receiver = _receiver(default_blocks=2, timeout_s=0.05)
    chans = [Channel("e0", _sender(), die_on_call=1), Channel("e1", _sender(), hang_on_call=2)]
    with pytest.raises(EncodeFailedError, match="e0: ConnectionError.*e1: TimeoutError"):
        _fetch(receiver, chans, b"a:100")
    assert receiver.allocator.used_blocks == 0


def test_a_bad_chunk_is_refused_and_the_transfer_aborted():
    class Liar(Channel):
        async def transfer(self, req):
            chunk = await super().transfer(req)
            return TransferChunk(chunk.embeds, chunk.total_tokens, chunk.offset + 1, chunk.is_last)

    sender = _sender()
    liar = Liar("e0", sender)
    receiver = _receiver()
    with pytest.raises(EncodeFailedError, match="offset"):
        _fetch(receiver, [liar], b"a:50")
    assert liar.aborted == ["r"]
    assert receiver.allocator.used_blocks == 0 and sender.allocator.used_blocks == 0


def test_cancelling_the_request_aborts_the_encode():
    sender = _sender()
    ch = Channel("e0", sender, hang_on_call=2)
    ch.dead = False
    receiver = _receiver(default_blocks=2)

    async def scenario():
        task = asyncio.create_task(receiver.fetch("r", "h" * 64, b"a:100", [ch]))
        while len(ch.asks) < 2:
            await asyncio.sleep(0)
        ch.dead = False  # hung, not dead: it still hears the abort
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    assert ch.aborted == ["r"]
    assert receiver.allocator.used_blocks == 0 and sender.allocator.used_blocks == 0


def test_a_full_encode_side_passes_to_the_next_and_a_full_language_side_ends_the_fetch():
    from services.engine.multimodal.transfer import ReceiveBuffersFullError

    small, big = _sender(num_blocks=2), _sender()  # 32 rows cannot hold a 40-row image
    receiver = _receiver(num_blocks=4, default_blocks=2)
    got = _fetch(receiver, [Channel("e0", small), Channel("e1", big)], b"a:40")
    assert torch.equal(got, _embeds(b"a:40"))
    hog = receiver.allocator.alloc(64, "hog")
    with pytest.raises(ReceiveBuffersFullError):
        _fetch(receiver, [Channel("e1", big)], b"a:40")
    receiver.allocator.free(hog, "hog")
    assert receiver.allocator.used_blocks == 0 and big.allocator.used_blocks == 0 and small.allocator.used_blocks == 0


def test_rows_of_another_hidden_size_are_refused():
    sender = EmbeddingSender(EmbeddingBlockAllocator(16, BLOCK, 1), EmbeddingBuffers(16, BLOCK, HIDDEN + 1),
                             lambda _h, image: torch.zeros(20, HIDDEN + 1))
    receiver = _receiver()
    with pytest.raises(EncodeFailedError, match="another model"):
        _fetch(receiver, [Channel("e0", sender)], b"a:20")
    assert receiver.allocator.used_blocks == 0 and sender.allocator.used_blocks == 0
