"""BlockPool: exact block ids, LRU eviction order, prefix cache, KV events, dumps."""

from __future__ import annotations

import pytest

from services.api.kv_events import KvCleared, KvEvent, KvRemoved, KvStored, StoredBlock
from services.common.hashing import block_hashes
from services.engine.block_pool import BlockPool, BlockPoolIntegrityError
from tests.support.engine_factory import replay

BS = 4


def pool(n: int = 8) -> tuple[BlockPool, list[KvEvent]]:
    events: list[KvEvent] = []
    return BlockPool(n, BS, events.append, "w0"), events


def chain(n_blocks: int, start: int = 0):
    return block_hashes(list(range(start, start + n_blocks * BS)), BS)


def stored(p: BlockPool, ids: list[int], first: int = 0, start: int = 0) -> None:
    """Register ``ids`` as blocks first.. of the sequence range(start, ...)."""
    hs = chain(first + len(ids), start)
    parent = hs[first - 1].seq_hash if first else None
    p.cache(ids, hs[first:], parent, first)


def test_allocate_hands_out_exact_ids_and_reuses_freed_last() -> None:
    p, events = pool()
    assert p.allocate(3) == [0, 1, 2]
    assert p.allocate(2) == [3, 4]
    p.release([1])
    assert (p.num_used, p.num_cached, p.num_free) == (4, 0, 4)
    assert p.allocate(4) == [5, 6, 7, 1]
    assert p.allocate(1) is None  # all 8 used: nothing changes
    assert p.num_used == 8 and events == []
    assert p.allocate(0) == []  # allocating (and evicting) 0 is always safe
    p.check_integrity()


def test_cache_emits_stored_with_parent_and_monotonic_ids() -> None:
    p, events = pool()
    ids = p.allocate(3)
    hs = chain(3)
    p.cache(ids[:2], hs[:2], None, 0)
    p.cache(ids[2:], hs[2:], hs[1].seq_hash, 2)
    assert events == [
        KvStored("w0", 1, None, tuple(StoredBlock(h.seq_hash, h.local_hash) for h in hs[:2])),
        KvStored("w0", 2, hs[1].seq_hash, (StoredBlock(hs[2].seq_hash, hs[2].local_hash),)),
    ]
    assert [p.lookup(h.seq_hash) for h in hs] == ids
    p.check_integrity()


def test_unreferenced_cached_blocks_stay_reusable_until_evicted_lru() -> None:
    p, events = pool(6)
    a = p.allocate(3)  # [0, 1, 2]
    stored(p, a)
    b = p.allocate(2)  # [3, 4]
    stored(p, b, start=1000)
    p.release(reversed(a))  # tail first: 2, 1, 0
    p.release(reversed(b))  # 4, 3
    assert (p.num_used, p.num_cached, p.num_free) == (0, 5, 1)
    hs_a, hs_b = chain(3), chain(2, 1000)
    # a cached block with ref 0 is revived by a prefix hit and not evicted
    p.acquire([p.lookup(hs_a[0].seq_hash)])
    assert p.ref_count(0) == 1 and not p.is_evictable(0)
    events.clear()
    # free block 5 first, then least recently freed: 2, 1 (0 is referenced), then 4
    assert p.allocate(4) == [5, 2, 1, 4]
    assert events == [KvRemoved("w0", 3, (hs_a[2].seq_hash, hs_a[1].seq_hash, hs_b[1].seq_hash))]
    assert p.lookup(hs_a[1].seq_hash) is None and p.lookup(hs_b[0].seq_hash) == 3
    p.check_integrity()


def test_duplicate_hash_keeps_first_copy_and_second_goes_free() -> None:
    p, events = pool(4)
    x = p.allocate(1)
    y = p.allocate(1)
    stored(p, x)
    stored(p, y)  # same content computed twice: not registered again
    assert len(events) == 1 and p.lookup(chain(1)[0].seq_hash) == x[0]
    p.release(y)
    p.release(x)
    assert (p.num_cached, p.num_free) == (1, 3)
    p.check_integrity()


def test_misuse_raises_clear_errors() -> None:
    p, _ = pool(4)
    with pytest.raises(ValueError, match="released more often"):
        p.release([0])
    with pytest.raises(ValueError, match="only cached blocks"):
        p.acquire([1])
    ids = p.allocate(1)
    p.release(ids)
    with pytest.raises(ValueError, match="not referenced"):
        stored(p, ids)
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0, BS)


def test_integrity_check_names_the_problem() -> None:
    p, _ = pool(4)
    p.allocate(2)
    p._free.append(0)  # corrupt: block 0 is both used and free
    with pytest.raises(BlockPoolIntegrityError, match="two states"):
        p.check_integrity()


def test_dump_rebuilds_the_index_the_live_events_built() -> None:
    p, events = pool(8)
    a = p.allocate(3)
    stored(p, a)
    b = p.allocate(2)  # a fork: shares a's first block, then differs
    fork = block_hashes(list(range(BS)) + list(range(900, 900 + 2 * BS)), BS)
    p.cache(b, fork[1:], fork[0].seq_hash, 1)
    c = p.allocate(3)
    stored(p, c, start=500)
    p.release(reversed(a))
    p.release(reversed(b))
    p.release(reversed(c))
    p.allocate(4)  # evicts some cached blocks
    live = replay(events)
    dump = p.dump_events()
    assert isinstance(dump[0], KvCleared)
    assert all(e.event_id == p.last_event_id for e in dump)
    assert replay(dump) == live
    hashed = [p.block_hash(i) for i in range(8)]
    assert set(live) == {h.seq_hash for h in hashed if h is not None}
    # evicted 2, 1, 0, 4: the fork's first own block survives its evicted parent
    assert fork[2].seq_hash not in live and live[fork[1].seq_hash] == fork[0].seq_hash
    # a consumer that missed everything replays the dump on top of garbage
    assert replay(events[:1] + dump) == live
    p.check_integrity()


def test_evict_cached_frees_unreferenced_blocks_and_keeps_those_in_use() -> None:
    p, events = pool(6)
    hs = chain(4)
    ids = p.allocate(3)
    stored(p, ids)  # blocks 0-2 of one sequence
    p.release(ids[:0:-1])  # a finished request's tail: blocks 1, 2 cached, unreferenced
    other = p.allocate(1)
    stored(p, other, start=100)
    p.release(other)  # another prompt's block, cached
    assert p.evict_cached() == 3
    assert events[-1] == KvRemoved("w0", 3, (hs[2].seq_hash, hs[1].seq_hash, chain(1, 100)[0].seq_hash))
    assert (p.num_used, p.num_cached, p.num_free) == (1, 0, 5)
    assert p.lookup(hs[0].seq_hash) == ids[0]  # in use: kept, and still a hit
    assert p.lookup(hs[1].seq_hash) is None and p.lookup(chain(1, 100)[0].seq_hash) is None
    # the live sequence goes on caching after its kept block: the event stream still
    # rebuilds exactly what the pool holds (no block stored after an unknown parent)
    nxt = p.allocate(1)
    p.cache(nxt, hs[1:2], hs[0].seq_hash, 1)
    assert replay(events) == replay(p.dump_events())
    assert p.evict_cached() == 0 and events[-1].event_id == p.last_event_id  # nothing: no event
    p.release(nxt + ids[:1])
    assert p.num_cached == 2
    p.check_integrity()
