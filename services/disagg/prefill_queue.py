"""The prefill queue: a JetStream stream with work-queue retention and one durable pull
consumer shared by all prefill workers (docs/architecture.md, "Prefill queue").

A message is a ``PrefillJob`` (proto/prefill.proto); a job leaves the stream when a prefill
worker acks it. Decode workers read the queue depth (the consumer's pending + unacked
messages) for the remote-prefill decision, cached for ``queue_depth_cache_s`` because it is a
round trip to the server.

Queued prefill tokens are this decode worker's own remote prefills in flight (published and
not yet resolved): JetStream reports messages and bytes, not tokens, and a global count
would need a shared counter updated by every worker. With several decode workers the bound
is therefore per worker; the request-count bound is global.
"""

from __future__ import annotations

import asyncio
import logging
import time

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, RetentionPolicy, StorageType, StreamConfig

from services.api.prefill import PrefillJob
from services.api.prefill_codec import job_to_pb
from services.common.config import PrefillConfig
from services.common.nats_client import NatsClient, Subjects

log = logging.getLogger(__name__)

# A prefill worker's pull request waits this long for a job before it is issued again; the
# consumer serves waiting pull requests in the order they were issued (the simulator's
# choice of prefill worker follows from both).
PULL_WAIT_S = 1.0


async def ensure_prefill_queue(js: JetStreamContext, subjects: Subjects, cfg: PrefillConfig) -> None:
    """Create the stream and the shared durable consumer if they do not exist (idempotent)."""
    stream = StreamConfig(
        name=subjects.prefill_stream, subjects=[subjects.prefill_queue],
        retention=RetentionPolicy.WORK_QUEUE,
        # NOTE: jobs live seconds (they carry a deadline); memory is enough and fastest.
        storage=StorageType.MEMORY,
    )
    try:
        await js.add_stream(stream)
    except nats.js.errors.BadRequestError:
        await js.stream_info(subjects.prefill_stream)  # exists with another config: use it
    consumer = ConsumerConfig(
        durable_name=subjects.prefill_consumer, ack_policy=AckPolicy.EXPLICIT,
        ack_wait=cfg.ack_wait_s, max_deliver=cfg.max_deliver,
        max_ack_pending=-1,
    )
    try:
        await js.add_consumer(subjects.prefill_stream, consumer)
    except nats.js.errors.BadRequestError as e:
        log.warning("prefill consumer %s exists with another config (%s); using it",
                    subjects.prefill_consumer, e)
        await js.consumer_info(subjects.prefill_stream, subjects.prefill_consumer)


class PrefillQueue:
    """Decode side: publish jobs and read the queue depth. Create with ``await open(...)``."""

    def __init__(self, js: JetStreamContext, subjects: Subjects, depth_cache_s: float,
                 prefill: PrefillConfig | None = None, nc: NatsClient | None = None) -> None:
        self._js = js
        self._nc = nc
        self._prefill = prefill if prefill is not None else PrefillConfig()
        self._subjects = subjects
        self._cache_s = depth_cache_s
        self._depth = 0
        self._depth_at = float("-inf")
        self._tokens: dict[str, int] = {}  # request id -> effective prefill tokens in flight
        self._seqs: dict[str, int] = {}  # request id -> its job's stream sequence number
        # request id -> set at each progress report of the prefill worker running its job
        self._progress: dict[str, asyncio.Event] = {}
        self._progress_sub = None

    @classmethod
    async def open(cls, nc: NatsClient, subjects: Subjects, prefill: PrefillConfig,
                   depth_cache_s: float, decode_worker_id: str) -> PrefillQueue:
        """The queue as ``decode_worker_id`` uses it: it hears progress on its own jobs."""
        js = nc.jetstream()
        await ensure_prefill_queue(js, subjects, prefill)
        q = cls(js, subjects, depth_cache_s, prefill, nc)
        q._progress_sub = await nc.subscribe(subjects.prefill_progress(decode_worker_id),
                                             cb=q._on_progress)
        return q

    async def close(self) -> None:
        if self._progress_sub is not None:
            await self._progress_sub.unsubscribe()
            self._progress_sub = None

    async def _on_progress(self, msg) -> None:
        ev = self._progress.get(msg.data.decode("utf-8", "replace"))
        if ev is not None:
            ev.set()

    def progress(self, request_id: str) -> asyncio.Event:
        """Set whenever the prefill worker running this request's job reports progress
        (clear it to wait for the next report); forgotten by ``done``."""
        ev = self._progress.get(request_id)
        if ev is None:
            ev = self._progress[request_id] = asyncio.Event()
        return ev

    async def _recreate(self, e: Exception) -> None:
        """The stream or consumer is gone (a nats-server restarted without its store, or
        with the memory stream lost): create them again so later jobs can be queued."""
        log.warning("prefill queue missing (%s); creating it again", e)
        await ensure_prefill_queue(self._js, self._subjects, self._prefill)

    async def depth(self) -> int:
        """Jobs pending or delivered-but-unacked on the shared consumer (cached briefly)."""
        now = time.monotonic()
        if now - self._depth_at >= self._cache_s:
            try:
                info = await self._js.consumer_info(self._subjects.prefill_stream,
                                                    self._subjects.prefill_consumer)
            except nats.js.errors.NotFoundError as e:
                await self._recreate(e)
                info = await self._js.consumer_info(self._subjects.prefill_stream,
                                                    self._subjects.prefill_consumer)
            self._depth = int(info.num_pending or 0) + int(info.num_ack_pending or 0)
            self._depth_at = now
        return self._depth

    @property
    def queued_tokens(self) -> int:
        return sum(self._tokens.values())

    def reserve(self, request_id: str, effective_tokens: int) -> None:
        """Count a job's tokens as queued from the decision to send it on, before its
        publish: the decisions of a burst are taken before the first one publishes, and each
        must see the ones before it (``done`` forgets it)."""
        self._tokens[request_id] = effective_tokens

    async def publish(self, job: PrefillJob, effective_tokens: int) -> None:
        """Enqueue a job (waits for JetStream's ack); ``done(id)`` when it resolves."""
        self._tokens[job.request_id] = effective_tokens
        data = job_to_pb(job).SerializeToString()
        try:
            try:
                ack = await self._js.publish(self._subjects.prefill_queue, data)
            except (nats.js.errors.NoStreamResponseError, nats.js.errors.NotFoundError) as e:
                await self._recreate(e)
                ack = await self._js.publish(self._subjects.prefill_queue, data)
        except BaseException:
            self._tokens.pop(job.request_id, None)
            raise
        self._seqs[job.request_id] = ack.seq
        self._depth += 1  # NOTE: the cached depth sees our own job before the next refresh

    def done(self, request_id: str) -> int | None:
        """The job resolved (or was given up); returns its stream sequence, if published."""
        self._tokens.pop(request_id, None)
        self._progress.pop(request_id, None)
        return self._seqs.pop(request_id, None)

    async def retract(self, request_id: str, seq: int) -> bool:
        """Withdraw a job nobody waits for any more (its request was cancelled, or fell back
        to a local prefill): delete it from the stream, so no prefill worker takes it, and
        tell the one that may have taken it already to stop (``prefill_cancel``; a
        work-queue message stays in the stream until acked, so a deletion alone does not
        say whether a worker has it), so no prompt is prefilled twice. True if it was
        still in the stream."""
        deleted = False
        try:
            deleted = bool(await self._js.delete_msg(self._subjects.prefill_stream, seq))
        except (TimeoutError, nats.errors.Error, nats.js.errors.Error) as e:
            log.debug("retracting prefill job %d: %s", seq, e)
        if self._nc is not None:
            try:
                await self._nc.publish(self._subjects.prefill_cancel, request_id.encode())
            except (TimeoutError, nats.errors.Error) as e:
                log.debug("cancelling prefill job %s: %s", request_id, e)
        return deleted
