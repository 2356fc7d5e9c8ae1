"""Worker side of the KV event stream: batch the engine's events onto NATS and answer dumps.

What a worker must do for the router (docs/architecture.md, "KV events"):
- publish every KvStored/KvRemoved/KvCleared of its prefix cache, in order, with event ids
  increasing by exactly 1 from 1 (``on_events`` enforces it), on ``{ns}.kv.events.{worker}``;
- answer ``{ns}.kv.dump.{worker}`` requests with its whole cache as events (KvCleared, then
  KvStored chains), stamped with the last event id handed to the publisher *before* the
  snapshot was taken; events after that id may or may not be in the snapshot: the router
  replays them and every event is idempotent, so either is correct.

``session`` is random per publisher: a restarted worker's ids start again at 1, and the new
session tells the router to re-sync instead of ignoring them as replays.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import random
import threading
from collections.abc import Awaitable, Callable, Sequence

from nats.aio.msg import Msg

from services.api.kv_events import KvEvent
from services.api.wire import encode_dump, encode_event_batch
from services.common.nats_client import NatsClient, Subjects
from services.common.nats_client import flush as nats_flush
from services.common.service import cancel_and_wait

log = logging.getLogger(__name__)

# May return the events or an awaitable of them (a worker whose engine lives on another
# thread takes the snapshot there, e.g. ``AsyncEngine.dump_kv_events``).
DumpFn = Callable[[], "Sequence[KvEvent] | Awaitable[Sequence[KvEvent]]"]


class KvEventPublisher:
    """Owns a flush task and a dump subscription; use ``async with`` or start()/close().

    ``on_events`` may be called from any thread (the engine's block pool callback).
    ``dump`` is called on the event loop thread and must return a consistent snapshot.
    """

    def __init__(
        self,
        nc: NatsClient,
        subjects: Subjects,
        worker_id: str,
        dump: DumpFn,
        max_batch_events: int = 512,
        session: int | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.session = session if session is not None else random.getrandbits(62)
        self._nc = nc
        self._subjects = subjects
        self._dump = dump
        self._max_batch = max_batch_events
        self._lock = threading.Lock()
        self._pending: list[KvEvent] = []
        self._last_event_id = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._sub = None

    @property
    def last_event_id(self) -> int:
        return self._last_event_id

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._sub = await self._nc.subscribe(self._subjects.kv_dump(self.worker_id), cb=self._on_dump)
        self._task = asyncio.create_task(self._flush_loop(), name=f"kv publisher {self.worker_id}")
        self._task.add_done_callback(_log_death)

    async def __aenter__(self) -> KvEventPublisher:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def on_events(self, events: Sequence[KvEvent]) -> None:
        """Queue events for publishing. Raises ValueError if ids do not continue the sequence."""
        with self._lock:
            expect = self._last_event_id + 1
            for e in events:
                if e.worker_id != self.worker_id:
                    raise ValueError(f"event of worker {e.worker_id!r} given to publisher of {self.worker_id!r}")
                if e.event_id != expect:
                    raise ValueError(f"KV event id {e.event_id} of {self.worker_id!r}: expected {expect}")
                expect += 1
            self._pending.extend(events)
            self._last_event_id = expect - 1
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    def on_event(self, event: KvEvent) -> None:
        self.on_events((event,))

    async def flush(self) -> None:
        """Publish everything queued so far and flush the connection (a PING/PONG round
        trip to the server: once it returns, the server has the events)."""
        await self._publish_pending()
        await nats_flush(self._nc)

    async def _publish_pending(self) -> None:
        while True:
            with self._lock:
                batch = self._pending[: self._max_batch]
                del self._pending[: self._max_batch]
            if not batch:
                break
            await self._nc.publish(
                self._subjects.kv_events(self.worker_id),
                encode_event_batch(self.worker_id, self.session, batch),
            )

    async def _flush_loop(self) -> None:
        # NOTE: no round trip per batch: the client's own flusher writes a publish out at
        # once, and a PING/PONG after every request's events cost the worker and the
        # server more than the events themselves.
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self._publish_pending()

    async def _on_dump(self, msg: Msg) -> None:
        with self._lock:
            last = self._last_event_id  # NOTE: read before the snapshot (module docstring)
        try:
            snap = self._dump()
            if inspect.isawaitable(snap):
                snap = await snap
            events = list(snap)
            await msg.respond(encode_dump(self.worker_id, self.session, last, events))
        except Exception:
            log.exception("KV dump for %s failed", self.worker_id)

    async def close(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None


def _log_death(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("%s died: %r", task.get_name(), task.exception())
