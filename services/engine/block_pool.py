"""The page pool of the paged KV cache, with a prefix cache of full blocks (torch-free).

Every block is in exactly one of three states:

- **used**: referenced by at least one live sequence (``ref > 0``), cached or not;
- **cached**: unreferenced but registered in the prefix cache under its ``seq_hash``; it
  can be revived by a prefix hit until it is evicted (least recently freed first);
- **free**: unreferenced and holding nothing worth keeping.

``num_used + num_cached + num_free == num_blocks`` always (``check_integrity``).

Every change to the set of cached hashes is reported as a KV event (``KvStored``,
``KvRemoved``) with an event id that grows by one from 1, handed to ``on_event``
synchronously; a dump (``dump_events``) starts with ``KvCleared``. Hashes come only from
``services.common.hashing``.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence

from services.api.kv_events import KvCleared, KvEvent, KvRemoved, KvStored, StoredBlock
from services.common.hashing import BlockHash


class BlockPoolIntegrityError(AssertionError):
    """The pool's bookkeeping is inconsistent (a bug in the engine, never bad input)."""


class BlockPool:
    """Reference-counted KV blocks with an LRU prefix cache keyed by seq_hash.

    Contract:
    - ``allocate(n)`` returns ``n`` fresh, unhashed block ids with ``ref == 1``, taken from
      the free queue first and then by evicting cached blocks (least recently freed
      first, one ``KvRemoved`` per call); it returns None and changes nothing when fewer
      than ``n`` blocks are free or evictable. Allocating (and evicting) 0 is always safe.
    - ``acquire(ids)`` adds a reference to blocks found by ``lookup`` (prefix hits).
    - ``release(ids)`` drops one reference each; blocks reaching 0 become cached (if
      hashed) in the given order, so pass a sequence's blocks tail first to evict tails
      before their prefixes. Releasing an unreferenced block raises ValueError.
    - ``cache(...)`` registers full, referenced blocks in the prefix cache. A hash that is
      already cached under another block is skipped (that block stays private).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        on_event: Callable[[KvEvent], None] | None = None,
        worker_id: str = "",
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.worker_id = worker_id
        self._on_event = on_event
        self._last_event_id = 0
        self._ref = [0] * num_blocks
        self._hash: list[BlockHash | None] = [None] * num_blocks
        self._parent: list[int | None] = [None] * num_blocks  # parent seq_hash of a hashed block
        self._depth: list[int] = [0] * num_blocks  # block index within its sequence
        self._free: deque[int] = deque(range(num_blocks))
        # NOTE: cached blocks with ref 0, oldest release first; values unused.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._by_hash: dict[int, int] = {}  # seq_hash -> block id
        self._num_used = 0

    # ---- counters -------------------------------------------------------------------
    @property
    def num_used(self) -> int:
        """Blocks referenced by a live sequence."""
        return self._num_used

    @property
    def num_cached(self) -> int:
        """Unreferenced blocks kept for prefix hits (evictable)."""
        return len(self._evictable)

    @property
    def num_free(self) -> int:
        """Unreferenced blocks holding nothing."""
        return len(self._free)

    @property
    def num_available(self) -> int:
        """Blocks ``allocate`` can hand out now: free plus evictable."""
        return len(self._free) + len(self._evictable)

    @property
    def last_event_id(self) -> int:
        return self._last_event_id

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def is_evictable(self, block_id: int) -> bool:
        return block_id in self._evictable

    def block_hash(self, block_id: int) -> BlockHash | None:
        return self._hash[block_id]

    # ---- prefix cache ---------------------------------------------------------------
    def lookup(self, seq_hash: int) -> int | None:
        """The block cached under ``seq_hash`` (referenced or not), or None. Pure query."""
        return self._by_hash.get(seq_hash)

    def acquire(self, block_ids: Iterable[int]) -> None:
        """Add a reference to each (cached) block, taking it off the eviction list."""
        for b in block_ids:
            if self._ref[b] == 0:
                if b not in self._evictable:
                    raise ValueError(f"block {b} is free: only cached blocks can be acquired")
                del self._evictable[b]
                self._num_used += 1
            self._ref[b] += 1

    def cache(
        self,
        block_ids: Sequence[int],
        hashes: Sequence[BlockHash],
        parent_seq_hash: int | None,
        first_depth: int,
    ) -> None:
        """Register consecutive full blocks of one sequence in the prefix cache.

        ``block_ids[i]`` holds the block whose hashes are ``hashes[i]``, at depth
        ``first_depth + i`` of its sequence, chained after ``parent_seq_hash``. Emits one
        ``KvStored`` per run of newly stored blocks. Raises ValueError for an
        unreferenced block or one already hashed under a different hash.
        """
        # NOTE: per block of every prompt: lookups hoisted, and a StoredBlock made from the
        # BlockHash's tuple as it is (same fields, same order).
        ref, hashed, parents, depths, by_hash = (self._ref, self._hash, self._parent, self._depth,
                                                 self._by_hash)
        new = tuple.__new__
        run: list[StoredBlock] = []
        run_parent = parent_seq_hash
        parent = parent_seq_hash
        for i, (b, h) in enumerate(zip(block_ids, hashes, strict=True)):
            if ref[b] == 0:
                raise ValueError(f"block {b} is not referenced: cannot cache it")
            old = hashed[b]
            if old is not None:
                if old != h:
                    raise ValueError(f"block {b} is already cached as {old.seq_hash:#x}")
            elif h.seq_hash in by_hash:
                pass  # same content computed twice concurrently: keep the first copy
            else:
                hashed[b] = h
                parents[b] = parent
                depths[b] = first_depth + i
                by_hash[h.seq_hash] = b
                if not run:
                    run_parent = parent
                run.append(new(StoredBlock, h))
                parent = h.seq_hash
                continue
            if run:
                self._emit_stored(run_parent, run)
                run = []
            parent = h.seq_hash
        if run:
            self._emit_stored(run_parent, run)

    # ---- allocation -----------------------------------------------------------------
    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh blocks (ref 1, unhashed), or None (and no change) if they don't fit."""
        if n > len(self._free) + len(self._evictable):
            return None
        out: list[int] = []
        removed: list[int] = []
        free, ref = self._free, self._ref
        for _ in range(n):
            if free:
                b = free.popleft()
            else:
                b, _ = self._evictable.popitem(last=False)
                removed.append(self._uncache(b))
            ref[b] = 1
            out.append(b)
        self._num_used += n
        if removed:
            self._emit(KvRemoved(self.worker_id, self._next_id(), tuple(removed)))
        return out

    def _uncache(self, b: int) -> int:
        """Forget an evicted block's hash; its seq_hash, for the ``KvRemoved``."""
        h = self._hash[b]
        assert h is not None
        del self._by_hash[h.seq_hash]
        self._hash[b] = None
        self._parent[b] = None
        return h.seq_hash

    def release(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block; at zero it becomes cached or free."""
        ref, hashed, evictable, free = self._ref, self._hash, self._evictable, self._free
        unused = 0
        try:
            for b in block_ids:
                r = ref[b]
                if r <= 0:
                    raise ValueError(f"block {b} released more often than referenced")
                ref[b] = r - 1
                if r == 1:
                    unused += 1
                    if hashed[b] is not None:
                        evictable[b] = None
                    else:
                        free.append(b)
        finally:  # the blocks released before a bad one stay released
            self._num_used -= unused

    def evict_cached(self) -> int:
        """Evict every cached, unreferenced block (a prefix-cache reset); return how many.

        Blocks a live sequence references keep their hashes: they are in use, and a running
        sequence keeps caching its next blocks after them. One ``KvRemoved`` names them all.
        """
        removed = [self._uncache(b) for b in self._evictable]
        self._free.extend(self._evictable)
        self._evictable.clear()
        if removed:
            self._emit(KvRemoved(self.worker_id, self._next_id(), tuple(removed)))
        return len(removed)

    # ---- events ---------------------------------------------------------------------
    def dump_events(self) -> list[KvEvent]:
        """A snapshot of the whole prefix cache: ``KvCleared`` then ``KvStored`` events.

        Every event carries ``last_event_id`` (the snapshot point): a consumer replays the
        dump, then resumes with live events whose id is greater. Parents come before
        their children; emits nothing through ``on_event``.
        """
        eid = self._last_event_id
        out: list[KvEvent] = [KvCleared(self.worker_id, eid)]
        hashed = sorted((b for b in range(self.num_blocks) if self._hash[b] is not None),
                        key=lambda b: self._depth[b])
        for b in hashed:
            h = self._hash[b]
            assert h is not None
            out.append(KvStored(self.worker_id, eid, self._parent[b],
                                (StoredBlock(h.seq_hash, h.local_hash),)))
        return out

    def _next_id(self) -> int:
        self._last_event_id += 1
        return self._last_event_id

    def _emit_stored(self, parent: int | None, blocks: list[StoredBlock]) -> None:
        self._emit(KvStored(self.worker_id, self._next_id(), parent, tuple(blocks)))

    def _emit(self, event: KvEvent) -> None:
        if self._on_event is not None:
            self._on_event(event)

    # ---- invariants -----------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise BlockPoolIntegrityError unless every block is in exactly one state."""
        free = set(self._free)
        evictable = set(self._evictable)
        used = {b for b in range(self.num_blocks) if self._ref[b] > 0}
        problems: list[str] = []
        if len(free) != len(self._free):
            problems.append("a block is twice in the free queue")
        if free & evictable or free & used or evictable & used:
            problems.append("a block is in two states at once")
        total = len(free) + len(evictable) + len(used)
        if total != self.num_blocks:
            problems.append(f"free {len(free)} + cached {len(evictable)} + used {len(used)} "
                            f"= {total} != {self.num_blocks} blocks")
        if len(used) != self._num_used:
            problems.append(f"used counter {self._num_used} != {len(used)} referenced blocks")
        if any(r < 0 for r in self._ref):
            problems.append("negative reference count")
        for b in evictable:
            if self._hash[b] is None:
                problems.append(f"evictable block {b} has no hash")
        for b in free:
            if self._hash[b] is not None:
                problems.append(f"free block {b} still has a hash")
        for sh, b in self._by_hash.items():
            h = self._hash[b]
            if h is None or h.seq_hash != sh:
                problems.append(f"prefix cache maps {sh:#x} to block {b} holding {h}")
        if sum(h is not None for h in self._hash) != len(self._by_hash):
            problems.append("hashed blocks and the prefix cache index disagree")
        if problems:
            raise BlockPoolIntegrityError("block pool corrupt: " + "; ".join(problems))
