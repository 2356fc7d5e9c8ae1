"""Per-sequence KV block allocation on top of the block pool, with prefix-cache reuse."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

from services.common.hashing import BlockHash, ImageKey, block_hashes
from services.engine.block_pool import BlockPool
from services.engine.sequence import Sequence
from services.engine.write_fence import WriteFence


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """Cached blocks covering a sequence's first ``num_tokens`` tokens (block-aligned)."""

    block_ids: tuple[int, ...]
    num_tokens: int


NO_HIT = PrefixHit((), 0)


@dataclass(frozen=True, slots=True)
class KvAllocation:
    """What ``allocate`` did; opaque to the scheduler beyond "not None = it fits"."""

    new_block_ids: tuple[int, ...]
    num_hit_blocks: int


_NOTHING_NEW = KvAllocation((), 0)  # hoisted: most decode steps need no new block

class KvCacheManager:
    """Gives sequences block tables; registers full computed blocks in the prefix cache.

    Invariants kept on each Sequence: ``block_table`` covers at least the computed tokens;
    its first ``num_cached_blocks`` blocks are registered under ``block_hashes``.
    A prefix hit never covers more than ``num_tokens - 1`` tokens, so at least one token is
    computed and its logits sampled.
    """

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        # Every release goes through the fence: a forward in flight may still write them.
        self.fence = WriteFence(pool)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def _hashes(self, seq: Sequence, n_blocks: int) -> list[BlockHash]:
        """The sequence's first ``n_blocks`` block hashes, computing only the missing ones."""
        have = seq.block_hashes
        if len(have) < n_blocks:
            bs = self.block_size
            parent = have[-1].seq_hash if have else None
            have.extend(block_hashes(seq.token_ids[len(have) * bs : n_blocks * bs], bs, parent,
                                     seq.request.images, len(have) * bs))
        return have

    def _longest_hit(self, hashes: Seq[BlockHash], max_blocks: int) -> list[int]:
        lookup = self.pool.lookup
        out: list[int] = []
        for h in hashes[:max_blocks]:
            b = lookup(h.seq_hash)
            if b is None:
                break
            out.append(b)
        return out

    def match_prefix(self, seq: Sequence) -> PrefixHit:
        """The longest cached prefix of ``seq.token_ids`` (at most ``num_tokens - 1`` tokens)."""
        max_blocks = (seq.num_tokens - 1) // self.block_size
        if max_blocks <= 0:
            return NO_HIT
        ids = self._longest_hit(self._hashes(seq, max_blocks), max_blocks)
        return PrefixHit(tuple(ids), len(ids) * self.block_size)

    def prefix_hit_tokens(self, token_ids: Seq[int], images: Seq[ImageKey] = ()) -> int:
        """How many leading tokens of a prompt (with ``images``) this cache would serve (pure query)."""
        bs = self.block_size
        max_blocks = (len(token_ids) - 1) // bs
        if max_blocks <= 0:
            return 0
        hashes = block_hashes(token_ids[: max_blocks * bs], bs, None, images)
        return len(self._longest_hit(hashes, max_blocks)) * bs

    def blocks_to_grow(self, seq: Sequence, num_new_tokens: int) -> int:
        """Fresh blocks ``seq`` needs to hold ``num_new_tokens`` more computed tokens (<= 0:
        none)."""
        return -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size) - len(seq.block_table)

    def allocate(
        self, seq: Sequence, num_new_tokens: int, hit: PrefixHit = NO_HIT
    ) -> KvAllocation | None:
        """Make ``seq.block_table`` cover ``num_new_tokens`` more tokens, or return None.

        With a ``hit`` (only for a sequence holding no blocks) the hit blocks are taken
        first and ``seq.num_computed_tokens`` becomes ``hit.num_tokens``. None means the
        pool cannot hold it now; nothing changed and the caller preempts or waits.
        """
        table = seq.block_table
        pool = self.pool
        if not hit.block_ids:  # the per-step path: a running sequence grows
            need = self.blocks_to_grow(seq, num_new_tokens)
            if need <= 0:
                return _NOTHING_NEW
            new = pool.allocate(need)
            if new is None:
                return None
            table.extend(new)
            return KvAllocation(tuple(new), 0)
        if table:
            raise ValueError(f"{seq.request_id}: a prefix hit needs an empty block table")
        need = -(-(hit.num_tokens + num_new_tokens) // self.block_size) - len(hit.block_ids)
        # NOTE: reviving an unreferenced cached hit takes it out of the evictable set.
        revived = sum(1 for b in hit.block_ids if pool.ref_count(b) == 0)
        if need > pool.num_available - revived:
            return None
        pool.acquire(hit.block_ids)
        table.extend(hit.block_ids)
        seq.num_computed_tokens = hit.num_tokens
        seq.num_cached_blocks = len(hit.block_ids)
        if need <= 0:
            return KvAllocation((), len(hit.block_ids))
        new = pool.allocate(need)
        assert new is not None  # checked above
        table.extend(new)
        return KvAllocation(tuple(new), len(hit.block_ids))

    def cache_computed_blocks(self, seq: Sequence, num_computed: int | None = None) -> None:
        """Register the blocks that became full and computed since the last call.

        ``num_computed``: tokens whose KV is known written (a completed batch's end); the
        sequence's own count may run ahead of it while a batch is in flight."""
        if num_computed is None:
            num_computed = seq.num_computed_tokens
        n_full = num_computed // self.block_size
        start = seq.num_cached_blocks
        if n_full <= start:
            return
        hashes = self._hashes(seq, n_full)
        parent = hashes[start - 1].seq_hash if start else None
        self.pool.cache(seq.block_table[start:n_full], hashes[start:n_full], parent, start)
        seq.num_cached_blocks = n_full

    def share_prefix(self, parent: Sequence, child: Sequence, n_blocks: int) -> None:
        """Give ``child`` the first ``n_blocks`` of ``parent``'s blocks, one more reference
        each (the n-choices fork: the prompt's full blocks are computed once)."""
        shared = parent.block_table[:n_blocks]
        self.pool.acquire(shared)
        child.block_table = list(shared)
        child.num_computed_tokens = n_blocks * self.block_size

    def truncate(self, seq: Sequence, n_blocks: int) -> None:
        """Release every block after the first ``n_blocks`` (tail first)."""
        table = seq.block_table
        if n_blocks < len(table):
            self.fence.release(reversed(table[n_blocks:]))
            # A new list: a batch already handed to the runner keeps its own view.
            seq.block_table = table[:n_blocks]
            seq.num_cached_blocks = min(seq.num_cached_blocks, n_blocks)
            seq.num_computed_tokens = min(seq.num_computed_tokens, n_blocks * self.block_size)

    def free(self, seq: Sequence) -> None:
        """Release all of the sequence's blocks (cached ones stay cached) and reset it."""
        self.truncate(seq, 0)
