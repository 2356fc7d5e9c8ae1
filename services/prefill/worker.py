"""The prefill worker part: pull remote prefill jobs from the shared durable consumer, run
them on the engine (with its own prefix cache), stream the KV to the decode worker.

Delivery rules (docs/architecture.md, "Prefill queue"):
- pull only as many jobs as there are free slots (``prefill.max_concurrent_jobs``);
- a running job sends ``in_progress`` every ``prefill.in_progress_interval_s`` so JetStream
  does not redeliver it while it is being worked on;
- ack only after the decode worker answered the transfer; an answer of "not accepted" is
  acked too (the decode worker gave up or got it already: a retry cannot help);
- a failure here (engine error, decode worker unreachable) naks with a short delay so
  another worker retries; a job past its deadline is acked without work;
- a job is terminated without work (never retried: any worker would refuse it) when it
  carries no transfer token, or when discovery does not list its ``kv_transfer_address``
  for its ``decode_worker_id`` within ``prefill.discovery_wait_s``: KV, and with it the
  prompt, goes only to a registered decode worker, never to an address a job made up.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import nats.errors
from nats.aio.msg import Msg

from services.api.prefill import PrefillJob
from services.api.prefill_codec import job_from_bytes
from services.common.config import ClusterConfig
from services.common.discovery import Discovery
from services.common.errors import InvalidRequest
from services.common.nats_client import NatsClient, Subjects
from services.common.service import cancel_all_and_wait, cancel_and_wait
from services.disagg.kv_shm import host_id
from services.disagg.prefill_queue import PULL_WAIT_S, ensure_prefill_queue
from services.disagg.transfer_token import well_formed
from services.engine.async_engine import AsyncEngine
from services.engine.request import GenerateRequest
from services.prefill.decode_directory import DecodeDirectory
from services.prefill.kv_sender import KvSender, SentKv
from services.prefill.metrics import PrefillMetrics

log = logging.getLogger(__name__)

# An idle pull loop re-ensures the stream and consumer this often (they may be gone after a
# nats-server restart that lost the memory stream).
_ENSURE_IDLE_S = 3.0
# tandem_prefill_jobs_refused_total{reason} for a job without a well-formed transfer token
# (the others are decode_directory.Unlisted values).
NO_TOKEN = "no_token"


class PrefillWorker:
    """Owns a pull loop task and one task per running job; ``start()`` / ``close()``."""

    def __init__(self, engine: AsyncEngine, nc: NatsClient, cfg: ClusterConfig, worker_id: str,
                 metrics: PrefillMetrics | None = None) -> None:
        """``start()`` opens discovery on ``nc`` and watches the decode workers: a job's KV
        goes only to an address listed there (``self.decode_workers``)."""
        self.engine = engine
        self.cfg = cfg
        self.worker_id = worker_id
        self.metrics = metrics or PrefillMetrics(engine.stats)
        self._nc = nc
        self._subjects = Subjects(cfg.namespace)
        self._sender = KvSender(worker_id, cfg.prefill.kv_chunk_bytes, cfg.prefill.kv_shm_pool_bytes)
        self.decode_workers = DecodeDirectory()
        self._free = cfg.prefill.max_concurrent_jobs  # job slots not in use
        self._room = asyncio.Event()
        self._jobs: set[asyncio.Task[None]] = set()
        self._loop_task: asyncio.Task[None] | None = None
        self._psub = None
        self._cancel_sub = None
        # request id -> the task running its job, and the ids whose decode worker withdrew
        # them (prefill_cancel) while they ran
        self._running: dict[str, asyncio.Task[None]] = {}
        self._withdrawn: set[str] = set()

    async def start(self) -> None:
        # NOTE: watch discovery before pulling: jobs wait for it (bounded) otherwise.
        self.decode_workers.start(await Discovery.open(self._nc, self.cfg.namespace, self.cfg.discovery))
        js = self._nc.jetstream()
        await ensure_prefill_queue(js, self._subjects, self.cfg.prefill)
        self._cancel_sub = await self._nc.subscribe(self._subjects.prefill_cancel,
                                                    cb=self._on_cancel)
        self._psub = await js.pull_subscribe_bind(
            durable=self._subjects.prefill_consumer, stream=self._subjects.prefill_stream)
        self._loop_task = asyncio.create_task(self._pull_loop(), name=f"prefill pull {self.worker_id}")
        self._loop_task.add_done_callback(_log_death)

    @property
    def num_running(self) -> int:
        return len(self._jobs)

    async def stop_pulling(self) -> None:
        """Take no more jobs (running ones continue)."""
        if self._loop_task is not None:
            await cancel_and_wait(self._loop_task)
            self._loop_task = None

    async def close(self, grace_s: float = 0.0) -> None:
        """Stop pulling, give running jobs ``grace_s`` to finish, cancel the rest (their
        messages are redelivered to another worker after ack_wait)."""
        await self.stop_pulling()
        if self._jobs and grace_s > 0:
            await asyncio.wait(set(self._jobs), timeout=grace_s)
        await cancel_all_and_wait(list(self._jobs))
        for sub in (self._psub, self._cancel_sub):
            if sub is not None:
                try:
                    await sub.unsubscribe()
                except Exception as e:  # the connection may already be gone at shutdown
                    log.debug("prefill unsubscribe: %s", e)
        self._psub = self._cancel_sub = None
        await self._sender.close()
        await self.decode_workers.close()

    async def _on_cancel(self, msg) -> None:
        rid = msg.data.decode("utf-8", "replace")
        task = self._running.get(rid)
        if task is not None:
            self._withdrawn.add(rid)
            task.cancel()

    async def _pull_loop(self) -> None:
        assert self._psub is not None
        idle_since = time.monotonic()
        while True:
            while self._free == 0:
                self._room.clear()
                await self._room.wait()
            # NOTE: fetch as many jobs as there are free slots, never more.
            try:
                msgs = await self._psub.fetch(batch=self._free, timeout=PULL_WAIT_S)
            except (TimeoutError, nats.errors.TimeoutError):
                # NOTE: a fetch on a consumer that vanished (nats-server restarted, its memory
                # stream lost) only times out: while idle, re-ensure the queue now and then.
                if time.monotonic() - idle_since > _ENSURE_IDLE_S:
                    await self._ensure_queue()
                    idle_since = time.monotonic()
                continue
            except nats.errors.Error as e:
                log.warning("prefill fetch failed: %s", e)
                await asyncio.sleep(0.2)
                await self._ensure_queue()
                continue
            idle_since = time.monotonic()
            for m in msgs:
                self._free -= 1
                task = asyncio.create_task(self._run_job(m), name="prefill job")
                self._jobs.add(task)
                task.add_done_callback(self._job_done)

    async def _ensure_queue(self) -> None:
        """Create the stream and consumer again if they are gone (idempotent otherwise)."""
        try:
            await ensure_prefill_queue(self._nc.jetstream(), self._subjects, self.cfg.prefill)
        except (TimeoutError, nats.errors.Error) as e:  # still down: next time
            log.debug("prefill queue check failed: %s", e)

    def _job_done(self, task: asyncio.Task[None]) -> None:
        self._jobs.discard(task)
        self._free += 1
        self._room.set()
        if not task.cancelled() and task.exception() is not None:
            log.error("prefill job crashed: %r", task.exception())

    async def _run_job(self, msg: Msg) -> None:
        try:
            job = job_from_bytes(msg.data)
        except ValueError as e:  # a bad job never gets better
            log.warning("dropping malformed prefill job: %s", e)
            self.metrics.jobs.labels("malformed").inc()
            await msg.term()
            return
        remaining_s = job.deadline_unix_ms / 1000 - time.time()
        if remaining_s <= 0:
            self.metrics.jobs.labels("expired").inc()
            await msg.ack()
            return
        if not well_formed(job.transfer_token):
            await self._refuse(msg, job, NO_TOKEN)
            return
        rid = job.request_id
        current = asyncio.current_task()
        assert current is not None
        self._running[rid] = current
        ticker = asyncio.create_task(self._keep_alive(msg, job), name=f"in-progress {rid}")
        try:
            why = await self.decode_workers.address_for(
                job.decode_worker_id, job.kv_transfer_address,
                min(self.cfg.prefill.discovery_wait_s, remaining_s))
            if why is not None:
                await self._refuse(msg, job, why.value)
                return
            sent = await self._prefill_and_send(msg, job)
        except asyncio.CancelledError:
            if rid not in self._withdrawn:
                raise  # shutting down: JetStream redelivers the job to another worker
            # NOTE: the decode worker prefills it itself now: drop the job for good.
            self.metrics.jobs.labels("withdrawn").inc()
            await _quietly(msg.term())
            return
        except InvalidRequest as e:  # e.g. a prompt longer than this engine's context
            log.warning("dropping prefill job %s: %s", job.request_id, e)
            self.metrics.jobs.labels("malformed").inc()
            await _quietly(msg.term())
            return
        except Exception as e:
            log.warning("prefill job %s failed (nak for retry): %s", job.request_id, e)
            self.metrics.jobs.labels("failed").inc()
            await _quietly(msg.nak(delay=self.cfg.prefill.nak_delay_s))
            return
        finally:
            ticker.cancel()
            self._running.pop(rid, None)
            self._withdrawn.discard(rid)
        ack = sent.ack
        self.metrics.jobs.labels("delivered" if ack.accepted else "rejected").inc()
        if ack.accepted:
            self.metrics.kv_bytes_sent.inc(ack.bytes_received)
            self.metrics.kv_transfers.labels(sent.transport).inc()
        await _quietly(msg.ack())

    async def _refuse(self, msg: Msg, job: PrefillJob, reason: str) -> None:
        """Terminate a job this worker will not run: every worker would refuse it alike."""
        log.warning("refusing prefill job %s for %r at %r: %s", job.request_id,
                    job.decode_worker_id, job.kv_transfer_address, reason)
        self.metrics.jobs.labels("refused").inc()
        self.metrics.jobs_refused.labels(reason).inc()
        await _quietly(msg.term())

    async def _prefill_and_send(self, msg: Msg, job: PrefillJob) -> SentKv:
        delivery = msg.metadata.num_delivered if msg.metadata else job.attempt
        # NOTE: one sampled token with the request's own sampling (and seed): the first
        # token equals what a local prefill on the decode worker would sample.
        req = GenerateRequest(f"{job.request_id}@{delivery}", list(job.token_ids),
                              dataclasses.replace(job.sampling, max_tokens=1, n=1),
                              export_kv_from_block=job.first_block)
        # NOTE: the job entered this process from the queue: this is its one check.
        self.engine.validate(req)
        final = None
        async for out in self.engine.generate(req):
            final = out
        if final is None or final.kv is None or not final.token_ids:
            raise RuntimeError(f"engine returned no KV for {job.request_id!r}")
        if final.kv.shape[2] != job.num_blocks:
            raise RuntimeError(f"exported {final.kv.shape[2]} blocks, job asked {job.num_blocks}")
        same_host = bool(job.decode_host_id) and job.decode_host_id == host_id()
        # NOTE: the address was checked against discovery before the work (_run_job).
        return await self._sender.send(job.kv_transfer_address, job.request_id, final.kv,
                                       final.token_ids[0], job.first_block,
                                       timeout_s=self.cfg.prefill.kv_send_timeout_s,
                                       shm=same_host and self.cfg.prefill.kv_transport == "auto",
                                       token=job.transfer_token,
                                       first_logprob=final.logprobs[0] if final.logprobs else None)

    async def _keep_alive(self, msg: Msg, job: PrefillJob) -> None:
        """Tell JetStream (no redelivery) and the job's decode worker (keep waiting) that the
        job is being worked on: at once, then every ``in_progress_interval_s``."""
        subject = self._subjects.prefill_progress(job.decode_worker_id)
        rid = job.request_id.encode()
        while True:
            try:
                await self._nc.publish(subject, rid)
            except (TimeoutError, nats.errors.Error) as e:
                log.debug("progress of %s not sent: %s", job.request_id, e)
            await asyncio.sleep(self.cfg.prefill.in_progress_interval_s)
            await _quietly(msg.in_progress())


async def _quietly(coro) -> None:
    """An ack/nak whose failure (connection lost) only means JetStream redelivers later."""
    try:
        await coro
    except (TimeoutError, nats.errors.Error) as e:
        log.warning("JetStream ack failed (the job will be redelivered): %s", e)


def _log_death(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("%s died: %r", task.get_name(), task.exception())
