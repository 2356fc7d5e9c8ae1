"""Reusable /dev/shm segments (services/disagg/shm_pool.py): reuse only once the busy flag
is clear (for a lent payload: once every view of it is gone), the smallest fitting segment, eviction past the pool's bytes, segments past it
used once, and the peer's mappings kept least recently used first."""

from __future__ import annotations

import os

import pytest
import torch

from services.disagg import kv_shm
from services.disagg.shm_pool import (
    HEADER_BYTES,
    MIN_SEGMENT_BYTES,
    MappedSegments,
    SegmentPool,
    release_flag,
)

MB = 1 << 20
SEG = HEADER_BYTES + MIN_SEGMENT_BYTES  # the size of a segment for up to 1 MiB


@pytest.fixture
def made() -> list[str]:
    return []


@pytest.fixture
def pool(made: list[str]):
    def name() -> str:
        made.append(kv_shm.new_segment_name())
        return made[-1]

    p = SegmentPool(3 * SEG, name)
    yield p
    p.close()
    assert not any(os.path.exists(kv_shm.segment_path(n)) for n in made)


def test_off_pool_takes_nothing() -> None:
    assert SegmentPool(0, kv_shm.new_segment_name).take("a", 10) is None


def test_reused_only_once_the_flag_is_clear(pool: SegmentPool, made: list[str]) -> None:
    a = pool.take("peer", 100)
    assert a is not None and a.busy() and a.capacity == MIN_SEGMENT_BYTES and a.size == SEG
    a.write(torch.arange(25, dtype=torch.float32))
    assert torch.equal(a.payload(100).view(torch.float32), torch.arange(25, dtype=torch.float32))
    pool.kept(a)
    b = pool.take("peer", 100)  # a is still busy: the peer has not released it
    assert b is not a and len(made) == 2
    release_flag(a.mm)()
    assert pool.take("peer", 100) is a
    assert pool.take("other", 100) not in (a, b)  # per peer


def test_a_lent_payload_keeps_its_segment_busy_until_every_view_is_gone(pool: SegmentPool, made: list[str]) -> None:
    a = pool.take("peer", 100)
    pool.kept(a)
    a.write(torch.arange(25, dtype=torch.float32))
    rows = a.lend(100).view(torch.float32).view(5, 5)  # an image's tensor, as the receiver keeps it
    part = rows[1:3]
    del rows
    assert a.busy() and pool.take("peer", 100) is not a  # a view still reads it
    assert torch.equal(part.reshape(-1), torch.arange(5, 15, dtype=torch.float32))
    del part
    assert not a.busy() and pool.take("peer", 100) is a
    # dropped (evicted) while lent: still readable, and freeing the rows later is safe
    kept = a.lend(100).view(torch.float32)
    pool.drop(a)
    assert not os.path.exists(kv_shm.segment_path(a.name)) and not a.mm.closed
    assert torch.equal(kept, torch.arange(25, dtype=torch.float32))
    del kept
    assert a not in pool.segments("peer")


def test_sizes_round_up_to_a_power_of_two_and_the_smallest_fit_is_taken(made: list[str]) -> None:
    p = SegmentPool(16 * MB, kv_shm.new_segment_name)
    try:
        big, small = p.take("x", 3 * MB), p.take("x", MB)
        assert big.capacity == 4 * MB and small.capacity == MB
        for s in (big, small):
            p.kept(s)
            release_flag(s.mm)()
        assert p.take("x", 100) is small and p.take("x", 2 * MB) is big
    finally:
        p.close()


def test_eviction_and_segments_past_the_pool(pool: SegmentPool, made: list[str]) -> None:
    segs = [pool.take("p", 100) for _ in range(3)]
    assert all(s.pooled for s in segs) and pool.held_bytes == 3 * SEG
    fourth = pool.take("p", 100)  # the oldest is dropped (safe even while busy)
    assert fourth.pooled and not os.path.exists(kv_shm.segment_path(segs[0].name))
    assert pool.segments("p") == [*segs[1:], fourth]
    p2 = SegmentPool(SEG - 1, kv_shm.new_segment_name)
    once = p2.take("p", 100)
    assert once is not None and not once.pooled and p2.held_bytes == 0
    p2.kept(once)  # used once: closed here
    assert once.mm.closed
    p2.drop(once)


def test_idle_keeps_a_mapped_segment_and_drops_a_fresh_one(pool: SegmentPool) -> None:
    fresh = pool.take("p", 100)
    pool.idle(fresh)  # refused before the peer mapped it: its name is gone with the call
    assert pool.segments("p") == [] and fresh.mm.closed
    mapped = pool.take("p", 100)
    pool.kept(mapped)
    pool.idle(mapped)
    assert pool.segments("p") == [mapped] and not mapped.busy()
    pool.forget("p")
    assert pool.segments("p") == []


def test_mapped_segments_drop_the_least_recently_used() -> None:
    maps = MappedSegments(2 * SEG)
    names = [kv_shm.new_segment_name() for _ in range(3)]
    p = SegmentPool(8 * SEG, iter(names).__next__)
    try:
        segs = [p.take("x", 100) for _ in names]
        for s in segs:
            maps.add(s.name, kv_shm.map_segment(s.name, s.size))
        assert maps.get(names[0]) is None and maps.get(names[1]) is not None
        maps.add(names[0], kv_shm.map_segment(names[0], SEG))  # names[2] is now the oldest
        assert maps.get(names[2]) is None and len(maps) == 2 and maps.mapped_bytes == 2 * SEG
    finally:
        p.close()
