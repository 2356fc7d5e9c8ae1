"""KV cache events: what a worker's prefix cache stored, removed or cleared.

Shapes fixed by docs/architecture.md, "KV events". ``event_id`` is monotonic per worker, starting
at 1, so a consumer that sees a gap knows it missed something and asks for a full dump.
The engine produces these objects; their msgpack encoding on NATS is wire.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class StoredBlock(NamedTuple):
    """A named tuple: the engine makes one per block it caches."""

    seq_hash: int
    local_hash: int


@dataclass(frozen=True, slots=True)
class KvStored:
    """Blocks appended as a chain after ``parent_seq_hash`` (None: they start a sequence)."""

    worker_id: str
    event_id: int
    parent_seq_hash: int | None
    blocks: tuple[StoredBlock, ...]


@dataclass(frozen=True, slots=True)
class KvRemoved:
    worker_id: str
    event_id: int
    seq_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class KvCleared:
    """Every block of the worker is gone (a reset, or the start of a full dump)."""

    worker_id: str
    event_id: int


KvEvent = KvStored | KvRemoved | KvCleared
