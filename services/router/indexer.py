"""The router's prefix index: a radix tree over block hashes, fed by KV events.

Structure. A node is one block position: children are keyed by the child's ``local_hash``
(content only), so the path from the root spells a token prefix and a node's identity equals
its ``seq_hash``. Each node holds the set of workers that cache that block, as a bitmask over
small worker indices (one Python int ``&`` per level in the match walk instead of a set
intersection). ``lookup[worker][seq_hash] -> node`` lets a removal event, which names
blocks by seq_hash, find its node without a walk, and lets a stored event find its parent.

Complexity (n = blocks in an event or query, W = workers, N = nodes):
- ``apply_stored``: O(n) dict operations; ``apply_removed``: O(n) plus pruning emptied
  leaves (amortised O(1) each: a node is pruned at most once per creation).
- ``clear_worker`` / ``remove_worker``: O(blocks the worker holds).
- ``find_matches``: O(d + W) where d <= n is the matched depth: one dict lookup and one
  bitmask AND per level; the walk ends at the first miss or when no worker is left.
- Memory: O(N) nodes + O(sum of blocks per worker) lookup entries.

Invariant (checked by ``check_integrity``): a worker's bit is set on a node iff that node is
in the worker's lookup table, and every non-root node without workers has children.
Not thread-safe: the router mutates and reads it from one event loop.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


class UnknownParentError(KeyError):
    """A stored event chains after a block this worker is not known to hold: the index
    missed events for it, so the caller should ask the worker for a full dump."""


class _Node:
    __slots__ = ("children", "mask", "parent", "local_hash")

    def __init__(self, parent: _Node | None, local_hash: int) -> None:
        self.children: dict[int, _Node] = {}
        self.mask = 0
        self.parent = parent
        self.local_hash = local_hash


@dataclass(frozen=True, slots=True)
class OverlapScores:
    """Matched prefix length in blocks per worker (workers with 0 are absent)."""

    scores: dict[str, int]


class RadixIndex:
    """Prefix index over all workers' cached blocks. See the module docstring."""

    def __init__(self) -> None:
        self._root = _Node(None, 0)
        self._lookup: dict[str, dict[int, _Node]] = {}
        self._bit: dict[str, int] = {}  # worker -> bit value (1 << index)
        self._by_bit: dict[int, str] = {}
        self._free_bits: list[int] = []
        self._next_index = 0

    # ---- workers ---------------------------------------------------------------------
    def _worker_bit(self, worker_id: str) -> int:
        bit = self._bit.get(worker_id)
        if bit is None:
            # Reuse freed bits so masks stay as narrow as the live worker count.
            if self._free_bits:
                bit = self._free_bits.pop()
            else:
                bit = 1 << self._next_index
                self._next_index += 1
            self._bit[worker_id] = bit
            self._by_bit[bit] = worker_id
            self._lookup[worker_id] = {}
        return bit

    @property
    def workers(self) -> list[str]:
        return list(self._lookup)

    def num_blocks(self, worker_id: str | None = None) -> int:
        """Blocks held by one worker, or summed over all workers (a block held by two counts
        twice: this is what the index stores, not distinct prefixes)."""
        if worker_id is not None:
            return len(self._lookup.get(worker_id, ()))
        return sum(len(t) for t in self._lookup.values())

    def holds(self, worker_id: str, seq_hash: int) -> bool:
        return seq_hash in self._lookup.get(worker_id, {})

    # ---- events ----------------------------------------------------------------------
    def apply_stored(
        self,
        worker_id: str,
        parent_seq_hash: int | None,
        seq_hashes: Sequence[int],
        local_hashes: Sequence[int],
    ) -> None:
        """Record that ``worker_id`` cached a chain of blocks after ``parent_seq_hash``.

        Raises UnknownParentError (before changing anything) if the worker is not known to
        hold the parent. Storing a block the worker already holds is a no-op for that block.
        """
        if len(seq_hashes) != len(local_hashes):
            raise ValueError(
                f"stored event of {worker_id!r}: {len(seq_hashes)} seq hashes "
                f"but {len(local_hashes)} local hashes"
            )
        bit = self._worker_bit(worker_id)
        table = self._lookup[worker_id]
        if parent_seq_hash is None:
            node = self._root
        else:
            node = table.get(parent_seq_hash)  # type: ignore[assignment]
            if node is None:
                raise UnknownParentError(
                    f"worker {worker_id!r} stored blocks after unknown parent {parent_seq_hash:#x}"
                )
        for seq_hash, local_hash in zip(seq_hashes, local_hashes, strict=False):
            child = node.children.get(local_hash)
            if child is None:
                child = _Node(node, local_hash)
                node.children[local_hash] = child
            child.mask |= bit
            table[seq_hash] = child
            node = child

    def apply_removed(self, worker_id: str, seq_hashes: Iterable[int]) -> None:
        """Forget blocks the worker evicted; unknown hashes are ignored (replays are safe)."""
        table = self._lookup.get(worker_id)
        if table is None:
            return
        clear = ~self._bit[worker_id]
        pop, prune = table.pop, self._prune
        for seq_hash in seq_hashes:
            node = pop(seq_hash, None)
            if node is not None:
                node.mask &= clear
                if not node.mask and not node.children:  # else _prune keeps it: no call
                    prune(node)

    def clear_worker(self, worker_id: str) -> None:
        """Forget every block of the worker but keep it known (a KvCleared, or a dump)."""
        table = self._lookup.get(worker_id)
        if not table:
            return
        clear = ~self._bit[worker_id]
        for node in table.values():
            node.mask &= clear
        for node in table.values():
            self._prune(node)
        table.clear()

    def remove_worker(self, worker_id: str) -> None:
        """Forget the worker entirely and free its bit for reuse."""
        if worker_id not in self._lookup:
            return
        self.clear_worker(worker_id)
        del self._lookup[worker_id]
        bit = self._bit.pop(worker_id)
        del self._by_bit[bit]
        self._free_bits.append(bit)

    def _prune(self, node: _Node) -> None:
        # NOTE: a node stays while it has workers or children; an emptied leaf is removed and
        # its parent re-checked, so dead branches never accumulate.
        while node.parent is not None and not node.mask and not node.children:
            parent = node.parent
            if parent.children.get(node.local_hash) is node:
                del parent.children[node.local_hash]
            node.parent = None
            node = parent

    # ---- queries ---------------------------------------------------------------------
    def find_matches(self, local_hashes: Sequence[int], early_exit: bool = False) -> OverlapScores:
        """Per worker, how many leading blocks of ``local_hashes`` it holds contiguously.

        With ``early_exit`` the walk stops as soon as a single worker is left; that worker's
        score is then a lower bound (enough to pick it, cheaper for long prompts).
        """
        scores: dict[str, int] = {}
        node = self._root
        active = -1  # all bits
        depth = 0
        for h in local_hashes:
            child = node.children.get(h)
            if child is None:
                break
            still = active & child.mask
            if still != active:
                if depth:
                    self._score_bits(active & ~still, depth, scores)
                if not still:
                    active = 0
                    break
                active = still
            depth += 1
            # A single worker left: the mask is a power of two.
            if early_exit and not (active & (active - 1)):
                break
            node = child
        if active and depth:
            self._score_bits(active, depth, scores)
        return OverlapScores(scores)

    def _score_bits(self, mask: int, depth: int, scores: dict[str, int]) -> None:
        by_bit = self._by_bit
        while mask:
            low = mask & -mask
            worker = by_bit.get(low)
            if worker is not None:
                scores[worker] = depth
            mask ^= low

    # ---- checks ----------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise AssertionError if the lookup tables and node masks disagree (tests, idle)."""
        seen: dict[int, int] = {}
        for worker, table in self._lookup.items():
            bit = self._bit[worker]
            for node in table.values():
                assert node.mask & bit, f"{worker} in lookup but not in node mask"
                seen[id(node)] = seen.get(id(node), 0) | bit
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            assert node.mask == seen.get(id(node), 0), "node mask has a worker without lookup"
            assert node.mask or node.children, "empty leaf not pruned"
            stack.extend(node.children.values())
