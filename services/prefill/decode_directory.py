"""Where a prefill worker may send KV: the decode workers discovery lists, by instance id.

A job names its decode worker and that worker's KvTransfer address, but anyone who can
publish on the prefill queue can write a job, so the address alone would let a forged job
point the prefill worker's KV (and with it the prompt's content) at any host. The prefill
worker sends only to the address that discovery lists for the job's ``decode_worker_id``.

Start-up race: a job can arrive before this worker's discovery watch has seen its decode
worker (the watch just started, or the decode worker just registered), so ``address_for``
waits a bounded time for a registration that matches before it refuses.
"""

from __future__ import annotations

import asyncio
import enum

from services.common.address_book import AddressBook
from services.common.discovery import Discovery, Registration

DECODE_ROLE = "decode"


class Unlisted(enum.StrEnum):
    """Why a job's destination was refused (``tandem_prefill_jobs_refused_total{reason}``)."""

    UNKNOWN_WORKER = "unknown_decode_worker"  # no decode worker of that id in discovery
    ADDRESS_MISMATCH = "address_mismatch"  # registered, under another address


class DecodeDirectory:
    """Live decode worker registrations (an ``AddressBook`` of role ``decode`` that follows
    discovery once started), and a wait for one to be listed. Use from one event loop."""

    def __init__(self) -> None:
        self._book = AddressBook(DECODE_ROLE)
        self._book.on_change = self._notify
        self._changed = asyncio.Event()

    def start(self, discovery: Discovery) -> None:
        self._book.start(discovery)

    async def close(self) -> None:
        await self._book.close()

    def joined(self, reg: Registration) -> None:
        self._book.joined(reg)

    def left(self, instance_id: str) -> None:
        self._book.left(instance_id)

    def _notify(self) -> None:
        # NOTE: a fresh event per change wakes every waiter once; they re-check and, if still
        # unmatched, wait on the next one.
        self._changed.set()
        self._changed = asyncio.Event()

    def check(self, worker_id: str, address: str) -> Unlisted | None:
        """None if discovery lists ``address`` for ``worker_id`` now, else why not."""
        reg = self._book.get(worker_id)
        if reg is None:
            return Unlisted.UNKNOWN_WORKER
        if not address or reg.address != address:
            return Unlisted.ADDRESS_MISMATCH
        return None

    async def address_for(self, worker_id: str, address: str, wait_s: float) -> Unlisted | None:
        """Like ``check``, waiting up to ``wait_s`` for discovery to list it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while (why := self.check(worker_id, address)) is not None:
            left = deadline - loop.time()
            if left <= 0:
                return why
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except TimeoutError:
                return self.check(worker_id, address)
        return None
