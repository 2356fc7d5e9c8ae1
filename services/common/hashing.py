"""Block hashing shared by the engine's prefix cache, the router's index and the workers.

The contract (docs/architecture.md, "Block hashing"): tokens are u32 little-endian, a block is
``block_size`` tokens and a trailing partial block is never hashed.

    local_hash[i] = xxh3_64(block_bytes[i], seed=1337)
    seq_hash[0]   = local_hash[0]
    seq_hash[i]   = xxh3_64(le_u64(seq_hash[i-1]) + le_u64(local_hash[i]), seed=1337)

A block that holds image placeholder tokens also hashes the images it overlaps (as vLLM's
"extra keys" do): the placeholders are the same token for every image, so without this two
different images would share a prefix-cache entry. For each image overlapping the block,
in order, 16 bytes of its content hash and its offset relative to the block's first
position (i64 little-endian) are appended to the block's bytes:

    local_hash[i] = xxh3_64(block_bytes[i] + image_keys[i], seed=1337)

``local_hash`` names a block's content alone (the router's tree is navigated by it);
``seq_hash`` names the block together with everything before it (the engine keys its
prefix cache by it and KV events name blocks by it).
"""

from __future__ import annotations

import array
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import xxhash

HASH_SEED = 1337

_xxh3 = xxhash.xxh3_64_intdigest
_pack_pair = struct.Struct("<QQ").pack


@dataclass(frozen=True, slots=True)
class ImageKey:
    """An image's place in a prompt: ``length`` placeholder tokens from position ``offset``;
    ``content_hash`` is the hex sha256 of its bytes."""

    offset: int
    length: int
    content_hash: str


class BlockHash(NamedTuple):
    """One full block's identity: its chained ``seq_hash`` and content-only ``local_hash``.
    A named tuple: the engine makes one per prompt block, and a tuple is the cheapest object
    to make."""

    seq_hash: int
    local_hash: int


# array("I") packs a list of Python ints ~1.5x faster than np.asarray (the router hashes
# every prompt on its hot path); usable where it is the same u32 little-endian layout.
_ARRAY_U32 = array.array("I").itemsize == 4 and sys.byteorder == "little"


def _token_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    if _ARRAY_U32 and not isinstance(tokens, np.ndarray):
        return array.array("I", tokens).tobytes()  # OverflowError outside u32, like numpy
    return np.asarray(tokens, dtype="<u4").tobytes()


def local_block_hashes(tokens: Sequence[int] | np.ndarray, block_size: int,
                       images: Sequence[ImageKey] = (), first_pos: int = 0) -> list[int]:
    """Content hashes of every full block of ``tokens``; a partial tail is ignored.

    ``tokens[0]`` sits at prompt position ``first_pos`` (a multiple of ``block_size``);
    ``images`` are the prompt's images at absolute positions."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    data = _token_bytes(tokens)
    stride = 4 * block_size
    end = len(data) // stride * stride
    if not images:
        return [_xxh3(data[i : i + stride], HASH_SEED) for i in range(0, end, stride)]
    out = []
    for i in range(0, end, stride):
        start = first_pos + i // 4
        out.append(_xxh3(data[i : i + stride] + _image_bytes(images, start, start + block_size), HASH_SEED))
    return out


def _image_bytes(images: Sequence[ImageKey], lo: int, hi: int) -> bytes:
    """The extra key of a block spanning positions [lo, hi)."""
    return b"".join(bytes.fromhex(im.content_hash[:32]) + struct.pack("<q", im.offset - lo)
                    for im in images if im.offset < hi and im.offset + im.length > lo)


def chain_hash(parent_seq_hash: int | None, local_hash: int) -> int:
    """The seq_hash of a block whose parent block has ``parent_seq_hash`` (None: first block)."""
    if parent_seq_hash is None:
        return local_hash
    return _xxh3(_pack_pair(parent_seq_hash, local_hash), seed=HASH_SEED)


def seq_hashes(local_hashes: Sequence[int], parent_seq_hash: int | None = None) -> list[int]:
    """Chain ``local_hashes`` into seq_hashes, continuing after ``parent_seq_hash``."""
    out: list[int] = []
    append = out.append
    parent = parent_seq_hash
    for lh in local_hashes:  # NOTE: chain_hash inlined: this runs per block of every prompt
        parent = lh if parent is None else _xxh3(_pack_pair(parent, lh), HASH_SEED)
        append(parent)
    return out


def block_hashes(
    tokens: Sequence[int] | np.ndarray, block_size: int, parent_seq_hash: int | None = None,
    images: Sequence[ImageKey] = (), first_pos: int = 0,
) -> list[BlockHash]:
    """Both hashes of every full block of ``tokens``, chained after ``parent_seq_hash``
    (``images``, ``first_pos``: as in ``local_block_hashes``)."""
    out: list[BlockHash] = []
    append, new = out.append, tuple.__new__
    parent = parent_seq_hash
    for lh in local_block_hashes(tokens, block_size, images, first_pos):
        # NOTE: chain_hash and BlockHash() inlined (a third of the time on a long prompt)
        parent = lh if parent is None else _xxh3(_pack_pair(parent, lh), HASH_SEED)
        append(new(BlockHash, (parent, lh)))
    return out


def hash_block(parent_seq_hash: int | None, block_tokens: Sequence[int]) -> BlockHash:
    """Hash one full block given its parent's seq_hash; used as blocks fill during decode."""
    lh = _xxh3(_token_bytes(block_tokens), seed=HASH_SEED)
    return BlockHash(chain_hash(parent_seq_hash, lh), lh)
