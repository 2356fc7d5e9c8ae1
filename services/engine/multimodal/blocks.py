"""Contiguous block allocation for image-embedding buffers (transfer.py).

The buffer holds ``num_blocks * block_size`` embedding rows. An allocation is always a run
of contiguous blocks ``[start_block, start_block + num_blocks)``, so a transfer writes one
slice at row ``start_block * block_size``. The language side, which does not yet know how
many rows an image makes, takes ``alloc_default()``; the encode side, which does, takes
``alloc(num_tokens)``. Both sides return every allocation with ``free``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BlockAllocation:
    start_block: int
    num_blocks: int
    num_tokens: int  # rows this allocation is for (<= num_blocks * block_size)


class BlocksExhaustedError(RuntimeError):
    """No run of contiguous free blocks is long enough; the caller waits or fails the request."""


class EmbeddingBlockAllocator:
    """First-fit contiguous allocator. Not thread-safe: one owner (an event loop) calls it."""

    def __init__(self, num_blocks: int, block_size: int = 128, default_blocks: int = 8) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be positive")
        if not 0 < default_blocks <= num_blocks:
            raise ValueError(f"default_blocks ({default_blocks}) must be in 1..num_blocks ({num_blocks})")
        self.num_blocks, self.block_size, self.default_blocks = num_blocks, block_size, default_blocks
        self._owner: list[str | None] = [None] * num_blocks
        self._live: dict[int, tuple[BlockAllocation, str]] = {}  # start_block -> (allocation, owner)

    @property
    def used_blocks(self) -> int:
        return sum(a.num_blocks for a, _ in self._live.values())

    @property
    def default_tokens(self) -> int:
        return self.default_blocks * self.block_size

    def alloc_default(self, req_id: str) -> BlockAllocation:
        """The language side's first buffer: ``default_blocks`` blocks."""
        return self._alloc(self.default_blocks, self.default_tokens, req_id)

    def alloc(self, num_tokens: int, req_id: str) -> BlockAllocation:
        """Enough blocks for ``num_tokens`` rows."""
        if num_tokens <= 0:
            raise ValueError(f"num_tokens must be positive, got {num_tokens}")
        return self._alloc(-(-num_tokens // self.block_size), num_tokens, req_id)

    def alloc_up_to(self, num_tokens: int, req_id: str) -> BlockAllocation:
        """Blocks for ``num_tokens`` rows, or for as many as the longest free run holds (at
        least one block): a resume larger than the buffer proceeds in several rounds."""
        if num_tokens <= 0:
            raise ValueError(f"num_tokens must be positive, got {num_tokens}")
        want = -(-num_tokens // self.block_size)
        n = min(want, self.longest_free_run())
        if n == 0:
            raise BlocksExhaustedError(f"no free block ({self.num_blocks} of {self.num_blocks} held)")
        return self._alloc(n, min(num_tokens, n * self.block_size), req_id)

    def longest_free_run(self) -> int:
        best = run = 0
        for owner in self._owner:
            run = run + 1 if owner is None else 0
            best = max(best, run)
        return best

    def free(self, allocation: BlockAllocation, req_id: str) -> None:
        live = self._live.get(allocation.start_block)
        if live is None or live[0] != allocation or live[1] != req_id:
            raise ValueError(f"{allocation} is not held by {req_id!r}")
        del self._live[allocation.start_block]
        for b in range(allocation.start_block, allocation.start_block + allocation.num_blocks):
            self._owner[b] = None

    def _alloc(self, n: int, num_tokens: int, req_id: str) -> BlockAllocation:
        if n > self.num_blocks:
            raise BlocksExhaustedError(f"{num_tokens} tokens need {n} blocks; the buffer has {self.num_blocks}")
        run = 0
        for b, owner in enumerate(self._owner):
            run = run + 1 if owner is None else 0
            if run == n:
                start = b - n + 1
                for i in range(start, b + 1):
                    self._owner[i] = req_id
                allocation = BlockAllocation(start, n, num_tokens)
                self._live[start] = (allocation, req_id)
                return allocation
        raise BlocksExhaustedError(
            f"no {n} contiguous free blocks ({self.num_blocks - self.used_blocks} of {self.num_blocks} free)"
        )
