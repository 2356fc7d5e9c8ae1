"""The embedding transfer between a language side and an encode worker: an ask for an
image's rows and a chunk of them (proto/encode.proto; codec: embedding_codec.py;
the protocol itself: services/engine/multimodal/transfer.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class ShmTarget:
    """Where an encode worker on the language side's host may write the rows: a reusable
    /dev/shm segment of the language side's (services/disagg/shm_pool.py)."""

    host_id: str  # the language side's kv_shm.host_id(): only an equal one may use it
    name: str  # the segment (kv_shm.segment_path checks it)
    offset: int  # the rows' first byte in it
    size: int  # the whole segment's bytes


@dataclass(frozen=True, slots=True)
class TransferRequest:
    """Language -> encode: the first ask (``sent_tokens == 0``) or a resume."""

    req_id: str
    image_hash: str  # hex sha256 of ``image``
    image: bytes  # the encoded image file (PNG/JPEG/WebP)
    sent_tokens: int  # rows the language side already holds
    capacity_tokens: int  # rows its current allocation takes
    # Bytes of one row as the language side holds it (hidden x its dtype's size): sizes a
    # shared-memory target; 0: unknown (bytes only).
    row_bytes: int = 0
    shm: ShmTarget | None = None  # set by the transport (encode/client.py), never by the protocol


@dataclass(frozen=True, slots=True)
class TransferChunk:
    """Encode -> language: rows ``offset .. offset + len(embeds)`` of ``total_tokens``."""

    embeds: torch.Tensor  # (n, hidden), in the encode side's dtype (the model's)
    total_tokens: int  # the aux true length
    offset: int
    is_last: bool
    # The rows were written into the ask's ShmTarget (``embeds`` views that segment).
    placed: bool = False
    # ``embeds`` is memory of this chunk alone (no buffer or message anyone reuses; a shared
    # segment reused only once ``embeds`` and its views are gone): the receiver may keep it
    # as the image's tensor instead of copying it.
    owned: bool = False
    # Call once ``embeds`` was copied out: its memory (a pooled buffer) may be reused.
    release: Callable[[], None] = field(default=lambda: None, repr=False, compare=False)
