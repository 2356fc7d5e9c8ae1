"""KV event ingest: NATS event batches into the radix index, with gap repair by full dumps.

Per worker the ingest keeps ``(session, last_event_id)``. An event with id ``last + 1`` is
applied; ids ``<= last`` are replays and skipped; a larger id is a gap. A gap, a stored
event after an unknown parent, a new session (the worker restarted) or a worker seen for the
first time all trigger a *sync*: request ``{ns}.kv.dump.{worker}``, and while it is in flight
buffer that worker's batches. The dump replaces the worker's part of the index and sets
``last_event_id``; the buffered batches are then replayed through the same rules.

Every router replica subscribes to the same subjects (no queue group), so each applies the
same event stream and, after its own dumps, holds the same index.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import nats.errors
from nats.aio.msg import Msg

from services.common.nats_client import NatsClient, Subjects
from services.common.wire import (
    CLEARED,
    REMOVED,
    STORED,
    RawEventBatch,
    WireError,
    decode_dump_raw,
    decode_event_batch_raw,
)
from services.router.indexer import RadixIndex, UnknownParentError
from services.router.metrics import RouterMetrics

log = logging.getLogger(__name__)


@dataclass
class _WorkerSync:
    session: int | None = None
    last_event_id: int = 0
    syncing: bool = False
    overflowed: bool = False
    buffer: list[RawEventBatch] = field(default_factory=list)
    task: asyncio.Task[None] | None = None


class KvIngest:
    def __init__(
        self,
        nc: NatsClient | None,
        subjects: Subjects,
        index: RadixIndex,
        metrics: RouterMetrics,
        dump_timeout_s: float,
        max_buffered_batches: int,
    ) -> None:
        self._nc = nc
        self._subjects = subjects
        self._index = index
        self._metrics = metrics
        self._dump_timeout = dump_timeout_s
        self._max_buffered = max_buffered_batches
        self._workers: dict[str, _WorkerSync] = {}
        self._sub = None
        self._closed = False

    async def start(self, nc: NatsClient | None = None) -> None:
        """Subscribe to every worker's events (``nc`` replaces the one given at construction)."""
        if nc is not None:
            self._nc = nc
        if self._nc is None:
            raise RuntimeError("KvIngest.start needs a NATS connection")
        self._sub = await self._nc.subscribe(self._subjects.kv_events_all, cb=self._on_msg)
        for worker, st in self._workers.items():
            if st.syncing and st.task is None:
                self._start_sync(worker, st)

    async def close(self) -> None:
        self._closed = True
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None
        for w in list(self._workers):
            self._cancel(w)

    def synced(self, worker_id: str) -> bool:
        """True once the worker's part of the index is in step with its event stream."""
        s = self._workers.get(worker_id)
        return s is not None and s.session is not None and not s.syncing

    def last_event_id(self, worker_id: str) -> int:
        s = self._workers.get(worker_id)
        return s.last_event_id if s is not None else 0

    def mark_synced(self, worker_id: str, session: int, last_event_id: int = 0) -> None:
        """Declare the index in step with ``worker_id`` (session, last id) without a dump:
        for a worker known to start empty (the bench feeds events without NATS)."""
        s = self._workers.setdefault(worker_id, _WorkerSync())
        s.session, s.last_event_id = session, last_event_id

    # ---- discovery hooks -------------------------------------------------------------
    def worker_joined(self, worker_id: str) -> None:
        """A worker appeared in discovery: sync it unless its events already did."""
        s = self._workers.setdefault(worker_id, _WorkerSync())
        if s.session is None and not s.syncing:
            self._start_sync(worker_id, s)

    def worker_left(self, worker_id: str) -> None:
        self._cancel(worker_id)
        self._workers.pop(worker_id, None)
        self._index.remove_worker(worker_id)

    def _cancel(self, worker_id: str) -> None:
        s = self._workers.get(worker_id)
        if s is not None and s.task is not None:
            s.task.cancel()
            s.task = None

    # ---- events ----------------------------------------------------------------------
    async def _on_msg(self, msg: Msg) -> None:
        try:
            batch = decode_event_batch_raw(msg.data)
        except WireError as e:
            self._metrics.bad_messages.labels("kv_events").inc()
            log.warning("dropping undecodable KV event batch on %s: %s", msg.subject, e)
            return
        self.handle_batch(batch)

    def handle_batch(self, batch: RawEventBatch) -> None:
        s = self._workers.get(batch.worker_id)
        if s is None:
            s = self._workers[batch.worker_id] = _WorkerSync()
        if s.syncing:
            self._buffer(s, batch)
            return
        if s.session != batch.session:
            self._buffer(s, batch)
            self._start_sync(batch.worker_id, s)
            return
        self._apply(batch, s)

    def _apply(self, batch: RawEventBatch, s: _WorkerSync) -> None:
        index, worker = self._index, batch.worker_id
        applied = 0
        for ev in batch.events:
            eid = ev[1]
            if eid <= s.last_event_id:
                continue
            if eid != s.last_event_id + 1:
                self._gap(worker, s, batch)
                break
            try:
                kind = ev[0]
                if kind == STORED:
                    index.apply_stored(worker, ev[2], ev[3], ev[4])
                elif kind == REMOVED:
                    index.apply_removed(worker, ev[2])
                elif kind == CLEARED:
                    index.clear_worker(worker)
            except UnknownParentError:
                self._gap(worker, s, batch)
                break
            s.last_event_id = eid
            applied += 1
        self._metrics.events_applied.inc(applied)

    def _gap(self, worker: str, s: _WorkerSync, batch: RawEventBatch) -> None:
        self._metrics.gaps.inc()
        log.info("KV events of %s out of step after id %d: requesting a dump", worker, s.last_event_id)
        self._buffer(s, batch)  # replays skip what was applied already
        self._start_sync(worker, s)

    def _buffer(self, s: _WorkerSync, batch: RawEventBatch) -> None:
        if len(s.buffer) >= self._max_buffered:
            s.buffer.clear()
            s.overflowed = True  # the dump in flight is already stale: redo it after
        else:
            s.buffer.append(batch)

    # ---- dumps -----------------------------------------------------------------------
    def _start_sync(self, worker: str, s: _WorkerSync) -> None:
        s.syncing = True  # NOTE: out of step from now on, even before a dump can be sent
        if self._closed or s.task is not None or self._nc is None:
            return  # without a connection yet, start() sends the dump
        s.task = asyncio.create_task(self._sync(worker, s), name=f"kv dump {worker}")
        s.task.add_done_callback(_log_death)

    async def _sync(self, worker: str, s: _WorkerSync) -> None:
        assert self._nc is not None  # _start_sync runs only after start()
        delay = 0.05
        while True:
            s.overflowed = False
            try:
                reply = await self._nc.request(
                    self._subjects.kv_dump(worker), b"", timeout=self._dump_timeout
                )
                dump = decode_dump_raw(reply.data)
                if dump.worker_id != worker:
                    raise WireError(f"dump for {worker!r} answered by {dump.worker_id!r}")
            except (nats.errors.Error, asyncio.TimeoutError, WireError) as e:
                # No responders (not up yet), a timeout or garbage: retry until the worker
                # leaves discovery (worker_left cancels this task).
                self._metrics.dumps.labels("failed").inc()
                log.info("KV dump of %s failed (%s); retrying in %.2fs", worker, e, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
                continue
            if s.overflowed:
                continue
            break
        self._index.clear_worker(worker)
        for ev in dump.events:
            if ev[0] == STORED:
                try:
                    self._index.apply_stored(worker, ev[2], ev[3], ev[4])
                except UnknownParentError:
                    log.warning("dump of %s has a chain after an unknown parent; skipped", worker)
        self._metrics.dumps.labels("ok").inc()
        s.session, s.last_event_id = dump.session, dump.last_event_id
        s.syncing, s.task = False, None
        pending, s.buffer = s.buffer, []
        for batch in pending:
            self.handle_batch(batch)


def _log_death(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("%s died: %r", task.get_name(), task.exception())
