"""The embedding transfer between a language side and an encode worker: an ask for an
image's rows and a chunk of them (proto/encode.proto; codec: embedding_codec.py;
the protocol itself: services/engine/multimodal/transfer.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class TransferRequest:
    """Language -> encode: the first ask (``sent_tokens == 0``) or a resume."""

    req_id: str
    image_hash: str  # hex sha256 of ``image``
    image: bytes  # the encoded image file (PNG/JPEG/WebP)
    sent_tokens: int  # rows the language side already holds
    capacity_tokens: int  # rows its current allocation takes


@dataclass(frozen=True, slots=True)
class TransferChunk:
    """Encode -> language: rows ``offset .. offset + len(embeds)`` of ``total_tokens``."""

    embeds: torch.Tensor  # (n, hidden)
    total_tokens: int  # the aux true length
    offset: int
    is_last: bool
