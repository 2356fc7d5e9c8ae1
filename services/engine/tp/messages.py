"""What crosses from the entry rank to the other ranks (pickled over a pipe per rank).

Two channels, so a large payload never delays a step:

* payloads (background thread): ``RequestPayload`` once per request, as it arrives -- the
  prompt as raw int64 bytes and the image embeddings as raw bytes in their dtype,
  materialised by each rank itself;
* steps (step thread): ``StepMessage`` per forward -- only handles, positions, token counts,
  the tokens no payload carries (generated ones, or the overlapped loop's placeholders for
  them) and block-table changes -- plus the KV transfer commands, in order with the steps.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import torch

from services.model.image_spans import ImageSpan


@dataclass(slots=True)
class ImagePayload:
    """One image span of a prompt with its embeddings as raw bytes in their own dtype (no
    widening): ``embeds`` is a row-major (length, hidden) ``dtype`` tensor's memory."""

    offset: int
    length: int
    content_hash: str
    hidden: int
    dtype: str  # a torch dtype's name: "float32", "bfloat16", ...
    embeds: bytes

    @classmethod
    def of(cls, span: ImageSpan) -> ImagePayload:
        assert span.embeds is not None  # NOTE: LLMEngine.validate refuses spans without them
        e = span.embeds.detach().to("cpu").contiguous()  # (length, hidden)
        raw = e.view(torch.uint8).numpy().tobytes()
        return cls(span.offset, span.length, span.content_hash, e.shape[1], str(e.dtype).removeprefix("torch."), raw)

    def materialise(self) -> ImageSpan:
        data = torch.frombuffer(bytearray(self.embeds), dtype=torch.uint8)
        embeds = data.view(getattr(torch, self.dtype)).view(self.length, self.hidden)
        return ImageSpan(self.offset, self.length, self.content_hash, embeds)


@dataclass(frozen=True, slots=True)
class RankRequest:
    """What a rank holds of a request: its prompt and its images (embeddings included)."""

    prompt: list[int]
    images: tuple[ImageSpan, ...] = ()


@dataclass(slots=True)
class RequestPayload:
    handle: int
    prompt: bytes  # int64 token ids, array("q").tobytes()
    images: list[ImagePayload] = field(default_factory=list)
    # The request's other inputs as raw bytes, sent as they came (the bench's stand-in for
    # large inputs; `tandem bench tp` fills it).
    extras: bytes = b""

    @classmethod
    def of(cls, handle: int, prompt_token_ids: list[int], images: tuple[ImageSpan, ...] = (),
           extras: bytes = b"") -> RequestPayload:
        return cls(handle, array("q", prompt_token_ids).tobytes(), [ImagePayload.of(s) for s in images], extras)

    def materialise(self) -> RankRequest:
        ids = array("q")
        ids.frombytes(self.prompt)
        return RankRequest(ids.tolist(), tuple(i.materialise() for i in self.images))


@dataclass(slots=True)
class SeqWork:
    """One sequence's work in a step. Tokens at positions ``< num_prompt`` come from the
    payload; ``generated`` holds the chunk's tokens at positions ``>= num_prompt`` (a
    negative one is a placeholder, ``batch.placeholder``, resolved from the rank's future
    map). The block table of (``handle``, ``choice``) -- the choices of an n > 1 request
    share the handle and its payload -- is cut to ``keep_blocks`` entries and extended by
    ``new_blocks``."""

    handle: int
    choice: int
    start_pos: int
    num_tokens: int
    num_prompt: int
    generated: list[int]
    keep_blocks: int
    new_blocks: list[int]


@dataclass(slots=True)
class StepMessage:
    """``futures_count`` > 0 (the overlapped loop): before this step's forward, rank 0
    broadcasts the tokens the previous launched batch sampled (int64, (futures_count,)) and
    every rank writes them to its future slots ``futures_base ..``, as rank 0's sampler
    did to its own: this step's placeholders then resolve the same on every rank."""

    seqs: list[SeqWork]
    dropped: list[int] = field(default_factory=list)  # handles of requests that are gone
    futures_base: int = 0
    futures_count: int = 0


@dataclass(slots=True)
class FutureSlots:
    """Size the rank's future-token map (``ModelRunner.reserve_future_slots``)."""

    n: int


@dataclass(slots=True)
class ExportKv:
    """Send back this rank's KV heads of ``block_ids`` (every layer)."""

    block_ids: list[int]


@dataclass(slots=True)
class ImportKv:
    """Write ``data`` (this rank's KV-head slice) into ``block_ids``."""

    block_ids: list[int]
    data: torch.Tensor


@dataclass(slots=True)
class Shutdown:
    pass


@dataclass(slots=True)
class RankReady:
    rank: int


@dataclass(slots=True)
class RankFailed:
    rank: int
    error: str
