"""The worker that prefills gets a request's image embeddings here: through the
block transfer with resume (transfer.py) from an encode worker, or (``encode.replicas: 0``) from the vision model in its own
process, behind the same protocol (``LocalEncodeChannel``), so both paths use the same
blocks, resume and metrics."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from services.api.embedding import TransferChunk, TransferRequest
from services.api.images import ImageData, PromptImage
from services.engine.multimodal.blocks import EmbeddingBlockAllocator
from services.engine.multimodal.buffers import EmbeddingBuffers
from services.engine.multimodal.transfer import EmbeddingReceiver, EmbeddingSender, EncodeChannel
from services.model.image_spans import ImageSpan


class VisionEncoder:
    """Image bytes -> embeddings (tokens_per_image, hidden) in the model's dtype on the CPU, with an
    LRU cache keyed by the image's content hash. Not thread-safe: one thread calls it."""

    def __init__(self, model_dir: Path, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, cache_entries: int = 256) -> None:
        from services.engine.multimodal.image_processor import load_processor_config
        from services.engine.multimodal.vision_tower import ImageEncoder
        from services.engine.multimodal.weights import load_llava_dir

        w = load_llava_dir(model_dir)
        self.arch = w.arch
        self.dtype = dtype
        self.encoder = ImageEncoder(w.arch, dtype, device)
        self.encoder.load_hf_weights(w.vision, w.projector)
        self.processor = load_processor_config(model_dir, w.arch.vision.kind, w.arch.vision.image_size)
        self.cache_entries = cache_entries
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.cache_hits = 0
        self.images_encoded = 0

    @property
    def hidden_size(self) -> int:
        return self.arch.text.hidden_size

    def encode(self, content_hash: str, data: bytes) -> torch.Tensor:
        hit = self._cache.get(content_hash)
        if hit is not None:
            self._cache.move_to_end(content_hash)
            self.cache_hits += 1
            return hit
        from services.engine.multimodal.image_processor import preprocess

        pixels = preprocess(ImageData(data, content_hash, 0, 0).to_pil(), self.processor)[None]
        with torch.inference_mode():
            out = self.encoder(pixels)[0].cpu().clone()  # (tokens, hidden), self.dtype
        self.images_encoded += 1
        if self.cache_entries:
            self._cache[content_hash] = out
            while len(self._cache) > self.cache_entries:
                self._cache.popitem(last=False)
        return out


class LocalEncodeChannel:
    """An EncodeChannel over an EmbeddingSender in this process. The sender and its
    encoder run on one thread of their own: the event loop never waits for a forward."""

    def __init__(self, sender: EmbeddingSender, name: str = "local") -> None:
        self.sender, self.name = sender, name
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="mm-encode")

    async def transfer(self, req: TransferRequest) -> TransferChunk:
        return await asyncio.get_running_loop().run_in_executor(self._thread, self.sender.transfer, req)

    async def abort(self, req_id: str) -> None:
        await asyncio.get_running_loop().run_in_executor(self._thread, self.sender.abort, req_id)

    async def reap(self, stale_after_s: float) -> list[str]:
        """Free the transfers nobody resumed for ``stale_after_s`` (their language side died)."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, self.sender.reap, stale_after_s)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)


class ImageEmbedder:
    """A request's PromptImages -> ImageSpans with embeddings, from the encode channels
    ``channels()`` lists (in the order to try them)."""

    def __init__(self, receiver: EmbeddingReceiver, channels: Callable[[], Sequence[EncodeChannel]]) -> None:
        self.receiver, self.channels = receiver, channels

    async def embed(self, request_id: str, images: Sequence[PromptImage]) -> tuple[ImageSpan, ...]:
        """Raises EncodeFailedError, or ValueError when an image's embeddings do not fill
        its placeholders. Cancelling aborts the transfers (the encode side frees)."""
        chans = list(self.channels())
        embeds = await asyncio.gather(*(
            self.receiver.fetch(f"{request_id}/{i}", im.content_hash, im.image.data, chans)
            for i, im in enumerate(images)))
        return tuple(ImageSpan(im.offset, im.length, im.content_hash).with_embeds(e)
                     for im, e in zip(images, embeds, strict=True))


def local_embedder(encoder: VisionEncoder, block_size: int, default_blocks: int, num_blocks: int,
                   timeout_s: float) -> tuple[ImageEmbedder, LocalEncodeChannel]:
    """The embedder of a worker that encodes its own images: receiver and sender each with
    their own ``num_blocks`` buffer, as they would be on two machines."""
    hidden, dtype = encoder.hidden_size, encoder.dtype
    sender = EmbeddingSender(EmbeddingBlockAllocator(num_blocks, block_size, 1),
                             EmbeddingBuffers(num_blocks, block_size, hidden, dtype), encoder.encode)
    receiver = EmbeddingReceiver(EmbeddingBlockAllocator(num_blocks, block_size, default_blocks),
                                 EmbeddingBuffers(num_blocks, block_size, hidden, dtype), timeout_s)
    channel = LocalEncodeChannel(sender)
    return ImageEmbedder(receiver, lambda: [channel]), channel
