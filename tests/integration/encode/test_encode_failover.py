"""Seed 002's transfer against real encode workers on gRPC: an encode worker that dies
before or during a resume hands the transfer to another one (which resumes from
sent_tokens), a cancelled request aborts the encode, and no block stays held."""

from __future__ import annotations

import asyncio
import hashlib

import pytest
import torch

from services.engine.multimodal.blocks import EmbeddingBlockAllocator
from services.engine.multimodal.buffers import EmbeddingBuffers
from services.engine.multimodal.embedder import LocalEncodeChannel, VisionEncoder
from services.engine.multimodal.transfer import EmbeddingReceiver, EncodeFailedError
from tests.support.llava import encode_server, image_png, make_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("tiny-llava"))


class Spy(LocalEncodeChannel):
    """Records the asks; ``hang_on``: the n-th ask never answers (a worker that froze or
    whose machine went away mid-call), after doing its work when ``work_first``."""

    hang_on = 0
    work_first = False

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.asks = []
        self.aborted = []
        self.reached = asyncio.Event()

    async def transfer(self, req):
        self.asks.append(req)
        if len(self.asks) == self.hang_on:
            if self.work_first:
                await super().transfer(req)
            self.reached.set()
            await asyncio.Event().wait()
        return await super().transfer(req)

    async def abort(self, req_id):
        self.aborted.append(req_id)
        await super().abort(req_id)


def _receiver(model_dir, timeout_s: float = 30.0) -> EmbeddingReceiver:
    hidden = VisionEncoder(model_dir).hidden_size
    return EmbeddingReceiver(EmbeddingBlockAllocator(32, 4, 1), EmbeddingBuffers(32, 4, hidden), timeout_s)


def _want(model_dir, png: bytes) -> torch.Tensor:
    return VisionEncoder(model_dir).encode(hashlib.sha256(png).hexdigest(), png)


async def test_transfer_over_grpc_with_resumes_equals_the_encoder(model_dir):
    png = image_png((10, 120, 200))
    async with encode_server(model_dir, channel_cls=Spy) as (spy, channel, _):
        receiver = _receiver(model_dir)
        got = await receiver.fetch("r/0", hashlib.sha256(png).hexdigest(), png, [channel])
        assert [a.sent_tokens for a in spy.asks] == [0, 4]  # 4 rows, then the other 12
        assert spy.sender.allocator.used_blocks == 0
    assert torch.equal(got, _want(model_dir, png))
    assert receiver.allocator.used_blocks == 0


@pytest.mark.parametrize("when", ["before-resume", "during-resume"])
async def test_encode_worker_death_resumes_on_another(model_dir, when):
    png = image_png((200, 120, 10))
    async with encode_server(model_dir, name="e0", channel_cls=Spy) as (dying, ch0, server0), \
            encode_server(model_dir, name="e1", channel_cls=Spy) as (spare, ch1, _):
        receiver = _receiver(model_dir)
        # The first chunk comes back; the resume reaches e0, which dies before it sends
        # anything ("before") or after it has sent the rest into the void ("during").
        dying.hang_on, dying.work_first = 2, when == "during-resume"
        task = asyncio.create_task(receiver.fetch("r/0", hashlib.sha256(png).hexdigest(), png, [ch0, ch1]))
        await dying.reached.wait()
        await server0.stop(grace=0)  # the worker's process is gone
        got = await task
        assert [a.sent_tokens for a in spare.asks] == [4]  # resumed from what e0 had sent
        assert spare.sender.allocator.used_blocks == 0
        # e0's own blocks: nobody will resume there; its reaper frees them.
        await dying.reap(0.0)
        assert dying.sender.allocator.used_blocks == 0
    assert torch.equal(got, _want(model_dir, png))
    assert receiver.allocator.used_blocks == 0


async def test_no_encode_worker_left_fails_clearly(model_dir):
    png = image_png((1, 2, 3))
    async with encode_server(model_dir) as (_, ch0, server0):
        await server0.stop(grace=0)
        receiver = _receiver(model_dir, timeout_s=5.0)
        with pytest.raises(EncodeFailedError, match="encode-0: ConnectionError"):
            await receiver.fetch("r/0", hashlib.sha256(png).hexdigest(), png, [ch0])
    assert receiver.allocator.used_blocks == 0


async def test_cancelled_request_aborts_the_encode(model_dir):
    png = image_png((50, 60, 70))
    async with encode_server(model_dir, channel_cls=Spy) as (spy, channel, _):
        spy.hang_on = 2
        receiver = _receiver(model_dir)
        task = asyncio.create_task(receiver.fetch("r/0", hashlib.sha256(png).hexdigest(), png, [channel]))
        await spy.reached.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert spy.aborted == ["r/0"]
        assert spy.sender.allocator.used_blocks == 0 and spy.sender.in_flight == 0
    assert receiver.allocator.used_blocks == 0
