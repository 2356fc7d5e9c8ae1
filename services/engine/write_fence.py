"""Keeps freed KV blocks out of the pool while a launched forward may still write them.

With the overlapped loop a batch is computing while the scheduler thread finishes,
aborts or preempts sequences of that very batch. Their blocks must not go back to the
pool (to be handed to another sequence, or filled by a remote-prefill import on the
scheduler thread) until every forward that may write them has completed. Each launched
batch gets a ticket; a release made while tickets are outstanding is held until the
newest of them completes. With nothing in flight (the serial loop, unit tests driving
the scheduler directly) a release goes straight to the pool.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator

from services.engine.batch import PendingOutput
from services.engine.block_pool import BlockPool


class WriteFence:
    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self._launched = 0  # ticket of the newest launched batch
        self._completed = 0  # every ticket up to this one has completed
        self._pending: PendingOutput | None = None  # the newest launched batch's result
        self._held: deque[tuple[int, list[int]]] = deque()  # (ticket to wait for, blocks)

    @property
    def in_flight(self) -> bool:
        return self._completed != self._launched

    def launched(self, pending: PendingOutput) -> int:
        """Register a launched batch; its ticket, for ``completed``."""
        self._launched += 1
        self._pending = pending
        return self._launched

    def completed(self, ticket: int) -> None:
        """Batch ``ticket`` (and so every earlier one) has completed: release what waited."""
        self._completed = max(self._completed, ticket)
        if ticket == self._launched:
            self._pending = None
        held = self._held
        while held and held[0][0] <= ticket:
            self.pool.release(held.popleft()[1])

    def release(self, block_ids: Iterable[int]) -> None:
        """``pool.release`` now, or once the newest launched batch has completed."""
        if self._completed == self._launched:
            self.pool.release(block_ids)
        else:
            self._held.append((self._launched, list(block_ids)))

    def drain(self) -> int:
        """Wait for the batch in flight and release every held block; how many were held.
        A sync: only for the rare paths that need the blocks now (preemption, an import)."""
        n = sum(len(b) for _, b in self._held)
        if self._pending is not None:
            self._pending.wait()
            self.completed(self._launched)
        return n

    def held_blocks(self) -> Iterator[int]:
        """Blocks whose reference the fence holds (one per held release)."""
        for _, blocks in self._held:
            yield from blocks
