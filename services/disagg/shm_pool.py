"""Reusable /dev/shm segments: a large payload crosses with one copy in and one out at
memory speed. A fresh tmpfs file per transfer (kv_shm's one-shot segment) spends most of its
time allocating and zeroing pages, not copying; a segment written again lands in pages
that are mapped already.

Layout: a ``HEADER_BYTES`` control page, then the payload. Byte 0 of the header is the busy
flag. The owner (the process that created the segment) sets it when it hands the segment to
a transfer; whoever finishes with the payload clears it: the KV receiver once the engine
imported the KV (``ReceivedKv.release``); for an embedding transfer (the language side owns
the segment) the last reference to the image's tensor, which is the payload itself
(``Segment.lend``). The owner reuses only segments whose flag is clear, and drops a segment
whose state it does not know (a cancelled or failed call): dropping is always safe, since a
dropped segment is never written again.

Lifetime: a segment is named in /dev/shm only until its first transfer ends: the peer unlinks
the file once mapped and the owner unlinks it after the call, whatever the outcome (as for
one-shot segments). From then on both ends reach it through their mappings (the peer keeps
its own by name in ``MappedSegments``); the pages go with the last mapping. So nothing is
left in /dev/shm after a transfer, and a peer that lost its mapping (restarted, evicted)
answers "unavailable": the owner drops the segment and writes a fresh one.
"""

from __future__ import annotations

import mmap
import os
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from services.disagg.kv_shm import ShmUnavailableError, segment_path, unlink_segment

HEADER_BYTES = 4096  # the payload starts on a page of its own
MIN_SEGMENT_BYTES = 1 << 20
_FREE, _BUSY = 0, 1


@dataclass(eq=False, slots=True)
class Segment:
    name: str
    mm: mmap.mmap
    fresh: bool = True  # never mapped by the peer: its name is the only way there
    pooled: bool = True  # kept for reuse after the transfer (False: past the pool's bytes)

    @property
    def size(self) -> int:
        return len(self.mm)

    @property
    def capacity(self) -> int:
        return len(self.mm) - HEADER_BYTES

    def busy(self) -> bool:
        return self.mm[0] != _FREE

    def payload(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor over the first ``nbytes`` of the payload (it writes the segment)."""
        return payload_view(self.mm, HEADER_BYTES, nbytes)

    def lend(self, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of the payload as a uint8 tensor that keeps the segment busy:
        its flag clears once that tensor and every view of it are gone, from whichever
        thread drops the last one (the owner may then reuse the segment). Once per ``take``."""
        # NOTE: through numpy because a torch storage cannot carry a callback: the array is
        # the storage's owner, so it dies with the last view, and its finalizer frees the flag.
        arr = np.frombuffer(self.mm, dtype=np.uint8, count=nbytes, offset=HEADER_BYTES)
        weakref.finalize(arr, release_flag(self.mm))
        return torch.from_numpy(arr)

    def write(self, data: torch.Tensor) -> None:
        """Copy a C-contiguous CPU tensor's bytes to the payload's start (the one copy in)."""
        src = data.reshape(-1).view(torch.uint8)
        self.payload(src.numel()).copy_(src)


def payload_view(mm: mmap.mmap, offset: int, nbytes: int) -> torch.Tensor:
    """``nbytes`` of ``mm`` from ``offset`` as a uint8 tensor, no copy (it keeps ``mm`` alive)."""
    return torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=offset)


def release_flag(mm: mmap.mmap) -> Callable[[], None]:
    """Clears the segment's busy flag (its owner may reuse it): call once nothing reads it."""
    def release() -> None:
        try:
            mm[0] = _FREE
        except ValueError:
            pass  # closed: the segment was dropped
    return release


def create_segment(name: str, size: int) -> mmap.mmap:
    """A new segment file of ``size`` bytes, its pages allocated up front (a full /dev/shm
    fails here with ShmUnavailableError, not with SIGBUS on a later write), mapped."""
    path = segment_path(name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        raise ShmUnavailableError(f"cannot create {path}: {e}") from e
    try:
        os.posix_fallocate(fd, 0, size)
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                         prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as e:
        unlink_segment(name)
        raise ShmUnavailableError(f"cannot allocate {size} bytes in {path}: {e}") from e
    finally:
        os.close(fd)


def _close(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:
        pass  # a tensor still views it (a cancelled copy): freed with that tensor


class SegmentPool:
    """The owner's segments, per peer (a decode worker's address, an encode worker's), at
    most ``max_bytes`` mapped in all; past that a transfer gets a segment that is dropped
    after it (``pooled=False``). ``max_bytes == 0``: ``take`` always answers None (the
    caller uses a one-shot segment or bytes). Use from one thread.
    """

    def __init__(self, max_bytes: int, new_name: Callable[[], str]) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._new_name = new_name
        # NOTE: least recently used first, across peers: the order eviction drops them in.
        self._held: OrderedDict[int, tuple[str, Segment]] = OrderedDict()

    @property
    def held_bytes(self) -> int:
        return sum(seg.size for _, seg in self._held.values())

    def segments(self, peer: str) -> list[Segment]:
        return [seg for p, seg in self._held.values() if p == peer]

    def take(self, peer: str, nbytes: int) -> Segment | None:
        """A free segment of ``peer``'s holding ``nbytes`` (the smallest), else a new one,
        its busy flag set; None if the pool is off. ShmUnavailableError if none can be made."""
        if self.max_bytes == 0:
            return None
        fits = [seg for p, seg in self._held.values() if p == peer and seg.capacity >= nbytes and not seg.busy()]
        if fits:
            seg = min(fits, key=lambda s: s.capacity)
            self._held.move_to_end(id(seg))
        else:
            # NOTE: a power of two, so that payloads of nearby sizes reuse one segment.
            size = HEADER_BYTES + max(MIN_SEGMENT_BYTES, 1 << max(0, nbytes - 1).bit_length())
            self._make_room(size)
            name = self._new_name()
            seg = Segment(name, create_segment(name, size), pooled=self.held_bytes + size <= self.max_bytes)
            if seg.pooled:
                self._held[id(seg)] = (peer, seg)
        seg.mm[0] = _BUSY
        return seg

    def kept(self, seg: Segment) -> None:
        """The peer mapped it and clears its flag when done (it may be reused after that)."""
        seg.fresh = False
        if not seg.pooled:
            _close(seg.mm)

    def idle(self, seg: Segment) -> None:
        """The peer will not read it (it refused the transfer): free for reuse if the peer
        has it mapped, else dropped (its name is gone, so the peer cannot map it any more)."""
        if seg.fresh or not seg.pooled:
            self.drop(seg)
        else:
            seg.mm[0] = _FREE

    def drop(self, seg: Segment) -> None:
        """Never use it again (its state is unknown, or the peer cannot map it)."""
        self._held.pop(id(seg), None)
        unlink_segment(seg.name)
        _close(seg.mm)

    def forget(self, peer: str) -> None:
        """Drop all of ``peer``'s segments (it lost its mappings: a restarted process)."""
        for seg in self.segments(peer):
            self.drop(seg)

    def close(self) -> None:
        for _, seg in list(self._held.values()):
            self.drop(seg)

    def _make_room(self, size: int) -> None:
        # NOTE: busy ones too: a dropped segment is never written again, whoever still reads it.
        while self._held and self.held_bytes + size > self.max_bytes:
            _, (_, seg) = self._held.popitem(last=False)
            self.drop(seg)



class MappedSegments:
    """The peer's mappings of owners' reusable segments, by name, least recently used
    dropped past ``max_bytes`` (a tensor still viewing a dropped one keeps it alive).
    Use from one thread."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._maps: OrderedDict[str, mmap.mmap] = OrderedDict()

    @property
    def mapped_bytes(self) -> int:
        return sum(len(mm) for mm in self._maps.values())

    def __len__(self) -> int:
        return len(self._maps)

    def get(self, name: str) -> mmap.mmap | None:
        mm = self._maps.get(name)
        if mm is not None:
            self._maps.move_to_end(name)
        return mm

    def add(self, name: str, mm: mmap.mmap) -> None:
        self._maps[name] = mm
        while self._maps and self.mapped_bytes > self.max_bytes:
            self._maps.popitem(last=False)

    def discard(self, name: str) -> None:
        self._maps.pop(name, None)
