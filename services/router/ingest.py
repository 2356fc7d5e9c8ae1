"""KV event ingest: NATS event batches into the radix index, with gap repair by full dumps.

Only registered decode workers are indexed: a worker is admitted by ``worker_joined`` (the
router's discovery watch) and forgotten, index and all, by ``worker_left``. Batches under
any other worker id are dropped and counted (``tandem_router_events_ignored_total``): anyone
who can publish on NATS could otherwise make the router hold blocks, and ask for dumps,
under as many made-up ids as it likes. (``mark_synced`` admits a worker too, for the bench
and tests that feed events without NATS.)

Per worker the ingest keeps ``(session, last_event_id)``. An event with id ``last + 1`` is
applied; ids ``<= last`` are replays and skipped; a larger id is a gap. A gap, a stored
event after an unknown parent, a new session (the worker restarted) or a worker joining all
trigger a *sync*: request ``{ns}.kv.dump.{worker}``, and while it is in flight buffer that
worker's batches. The dump replaces the worker's part of the index and sets
``last_event_id``; the buffered batches are then replayed through the same rules, except
that one of another session than the dump's starts one more sync instead of being buffered
again (which would loop: a dump per round, forever, for one stale or forged batch).

Bounds per worker: at most ``max_blocks_per_worker`` blocks in the index (a stored event
past it is refused and counted; chains after refused blocks are refused too, not treated as
gaps, until the worker's index is cleared), at most ``max_buffered_batches`` batches and
``max_blocks_per_worker`` blocks buffered during a sync (beyond it the dump is redone). A
failed dump is retried after 0.05 s, doubling per failure up to ``dump_retry_max_s``; two
dumps of one worker are at least ``MIN_DUMP_INTERVAL_S`` apart.

Every router replica subscribes to the same subjects (no queue group), so each applies the
same event stream and, after its own dumps, holds the same index.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import nats.errors
from nats.aio.msg import Msg

from services.api.wire import (
    CLEARED,
    REMOVED,
    STORED,
    RawEventBatch,
    WireError,
    decode_dump_raw,
    decode_event_batch_raw,
)
from services.common.config import RouterConfig
from services.common.nats_client import NatsClient, Subjects
from services.router.indexer import RadixIndex, UnknownParentError
from services.router.metrics import RouterMetrics

log = logging.getLogger(__name__)

_ROUTER_DEFAULTS = RouterConfig()
FIRST_RETRY_S = 0.05  # the first retry of a failed dump; doubled per failure
# Two dumps of one worker are at least this far apart, whatever asks for them: a publisher
# of forged batches under a worker's id can then cost that worker at most a dump or two a
# second per router, and a lost event is still repaired within it.
MIN_DUMP_INTERVAL_S = 0.5


@dataclass
class _WorkerSync:
    session: int | None = None
    last_event_id: int = 0
    syncing: bool = False
    overflowed: bool = False
    buffer: list[RawEventBatch] = field(default_factory=list)
    buffered_blocks: int = 0  # stored blocks in ``buffer``
    # Blocks were refused for the bound since the index was last cleared: a chain after an
    # unknown parent is then most likely after a refused block, not a gap.
    truncated: bool = False
    retry_delay: float = FIRST_RETRY_S
    next_dump_at: float = 0.0  # event loop time
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
        max_blocks_per_worker: int = _ROUTER_DEFAULTS.max_blocks_per_worker,
        dump_retry_max_s: float = _ROUTER_DEFAULTS.dump_retry_max_s,
    ) -> None:
        self._nc = nc
        self._subjects = subjects
        self._index = index
        self._metrics = metrics
        self._dump_timeout = dump_timeout_s
        self._max_buffered = max_buffered_batches
        self._max_blocks = max_blocks_per_worker
        self._retry_max = dump_retry_max_s
        self._workers: dict[str, _WorkerSync] = {}
        self._sub = None
        self._closed = False
        metrics.buffered_blocks.set_function(self.buffered_blocks)

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

    def admitted(self, worker_id: str) -> bool:
        """True while the worker's events are indexed (it joined and has not left)."""
        return worker_id in self._workers

    def buffered_blocks(self) -> int:
        """Stored blocks held in sync buffers, summed over workers (not yet in the index)."""
        return sum(s.buffered_blocks for s in self._workers.values())

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
            # NOTE: not a registered decode worker (yet): nothing is kept. One that registers
            # later is synced by a dump when it joins, which covers these events.
            self._metrics.events_ignored.labels("kv_events", "unregistered").inc()
            return
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
            kind = ev[0]
            if kind == STORED:
                if not self._store(worker, s, ev):
                    self._gap(worker, s, batch)
                    break
            elif kind == REMOVED:
                index.apply_removed(worker, ev[2])
            elif kind == CLEARED:
                index.clear_worker(worker)
                s.truncated = False
            s.last_event_id = eid
            applied += 1
        self._metrics.events_applied.inc(applied)

    def _store(self, worker: str, s: _WorkerSync, ev: list) -> bool:
        """Apply a stored event within the worker's bound; False for a gap (unknown parent).
        A refused event counts as applied: its id is consumed, its blocks are not indexed."""
        if self._index.num_blocks(worker) + len(ev[3]) > self._max_blocks:
            if not s.truncated:
                log.warning("KV index of %s is at router.max_blocks_per_worker (%d): refusing "
                            "further stored blocks until it shrinks", worker, self._max_blocks)
            s.truncated = True
            self._metrics.events_ignored.labels("kv_events", "over_limit").inc()
            return True
        try:
            self._index.apply_stored(worker, ev[2], ev[3], ev[4])
        except UnknownParentError:
            if s.truncated:  # after a refused block: refused as well
                self._metrics.events_ignored.labels("kv_events", "over_limit").inc()
                return True
            return False
        return True

    def _gap(self, worker: str, s: _WorkerSync, batch: RawEventBatch) -> None:
        self._metrics.gaps.inc()
        log.info("KV events of %s out of step after id %d: requesting a dump", worker, s.last_event_id)
        self._buffer(s, batch)  # replays skip what was applied already
        self._start_sync(worker, s)

    def _buffer(self, s: _WorkerSync, batch: RawEventBatch) -> None:
        blocks = sum(len(ev[3]) for ev in batch.events if ev[0] == STORED)
        if len(s.buffer) >= self._max_buffered or s.buffered_blocks + blocks > self._max_blocks:
            s.buffer.clear()
            s.buffered_blocks = 0
            s.overflowed = True  # the dump in flight is already stale: redo it after
        else:
            s.buffer.append(batch)
            s.buffered_blocks += blocks

    # ---- dumps -----------------------------------------------------------------------
    def _start_sync(self, worker: str, s: _WorkerSync) -> None:
        s.syncing = True  # NOTE: out of step from now on, even before a dump can be sent
        if self._closed or s.task is not None or self._nc is None:
            return  # without a connection yet, start() sends the dump
        s.task = asyncio.create_task(self._sync(worker, s), name=f"kv dump {worker}")
        s.task.add_done_callback(_log_death)

    async def _sync(self, worker: str, s: _WorkerSync) -> None:
        assert self._nc is not None  # _start_sync runs only after start()
        loop = asyncio.get_running_loop()
        while True:
            wait = s.next_dump_at - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            s.overflowed = False
            try:
                reply = await self._nc.request(
                    self._subjects.kv_dump(worker), b"", timeout=self._dump_timeout
                )
                dump = decode_dump_raw(reply.data)
                if dump.worker_id != worker:
                    raise WireError(f"dump for {worker!r} answered by {dump.worker_id!r}")
            except (TimeoutError, nats.errors.Error, WireError) as e:
                # No responders (not up yet), a timeout or garbage: retry, backing off, until
                # the worker leaves discovery (worker_left cancels this task).
                self._metrics.dumps.labels("failed").inc()
                log.info("KV dump of %s failed (%s); retrying in %.2fs", worker, e, s.retry_delay)
                s.next_dump_at = loop.time() + s.retry_delay
                s.retry_delay = min(s.retry_delay * 2, self._retry_max)
                continue
            s.retry_delay = FIRST_RETRY_S
            s.next_dump_at = loop.time() + MIN_DUMP_INTERVAL_S
            if s.overflowed:
                continue
            break
        self._index.clear_worker(worker)
        s.truncated = False
        refused = orphans = 0
        for ev in dump.events:
            if ev[0] == STORED:
                if self._index.num_blocks(worker) + len(ev[3]) > self._max_blocks:
                    s.truncated = True
                    refused += 1
                    continue
                try:
                    self._index.apply_stored(worker, ev[2], ev[3], ev[4])
                except UnknownParentError:
                    orphans += 1  # after a refused block, or a dump out of order
        if refused or orphans:
            self._metrics.events_ignored.labels("kv_events", "over_limit").inc(refused)
            log.warning("dump of %s: %d stored events over router.max_blocks_per_worker, %d after "
                        "an unknown parent; not indexed", worker, refused, orphans)
        self._metrics.dumps.labels("ok").inc()
        s.session, s.last_event_id = dump.session, dump.last_event_id
        s.syncing, s.task = False, None
        pending, s.buffer, s.buffered_blocks = s.buffer, [], 0
        for batch in pending:
            if not s.syncing and batch.session != s.session:
                # NOTE: the worker restarted after the dump (or the batch is forged): one
                # more dump settles it, and the batch is not buffered again.
                self._metrics.events_ignored.labels("kv_events", "stale_session").inc()
                self._start_sync(worker, s)
                continue
            self.handle_batch(batch)


def _log_death(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("%s died: %r", task.get_name(), task.exception())
