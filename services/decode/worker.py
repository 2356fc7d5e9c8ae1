"""The decode worker part: generate over an AsyncEngine, prefilling locally or remotely.

``DecodeWorker.generate`` is the whole request path; the gRPC servicer only translates.

Remote path (``services.decode.disagg`` decides): park the request with blocks for its
uncached part (``AsyncEngine.begin_remote_prefill``), wait for its KV in the ``KvReceiver``,
publish a ``PrefillJob``, then either import the KV (``complete_remote_prefill``)
or, when no prefill worker reports progress for ``remote_prefill_timeout_s`` / on bad KV /
on a publish failure, prefill locally and withdraw the job
(``fail_remote_prefill``). Either way the tokens come from ``AsyncEngine.stream``. A
request's blocks never leak: every exit (finish, abort, cancelled call) ends in the engine
freeing them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import replace

from services.api.images import PromptImage
from services.api.move import MoveSource
from services.api.outputs import TokenOutput
from services.api.prefill import PrefillJob
from services.common.config import ClusterConfig
from services.common.errors import InvalidRequest, Overloaded, RequestMoved, Unavailable
from services.decode.admission import refusal
from services.decode.arrival_rate import ArrivalRate
from services.decode.disagg import DecisionReason, PrefillDecision, decide_prefill, worker_times
from services.decode.kv_receiver import ExpectedKv, KvReceiver, KvTransferError, ReceivedKv
from services.decode.metrics import DecodeMetrics
from services.decode.move_in import MoveReceiver
from services.decode.move_out import MoveOutbox
from services.disagg.kv_shm import host_id
from services.disagg.prefill_outcome import FallbackReason, PrefillLocation
from services.disagg.prefill_queue import PrefillQueue
from services.disagg.shm_pool import MappedSegments
from services.disagg.transfer_token import new_token
from services.engine.async_engine import AsyncEngine, RequestMoving
from services.engine.multimodal.embedder import ImageEmbedder
from services.engine.multimodal.transfer import EncodeFailedError, ReceiveBuffersFullError
from services.engine.remote_prefill import RemoteKvError, RemotePrefillHandle
from services.engine.request import GenerateRequest
from services.steptime.model import StepModel
from services.steptime.profile import step_model_for

log = logging.getLogger(__name__)

PEERS_TIMEOUT_S = 2.0  # how long a drain asks discovery for other decode workers


class DecodeWorker:
    """One decode worker. ``queue`` None runs without disaggregation (always local)."""

    def __init__(self, engine: AsyncEngine, cfg: ClusterConfig, worker_id: str,
                 queue: PrefillQueue | None = None, kv_address: str = "",
                 metrics: DecodeMetrics | None = None, embedder: ImageEmbedder | None = None,
                 has_peers: Callable[[], Awaitable[bool]] | None = None) -> None:
        self.engine = engine
        self.cfg = cfg
        self.worker_id = worker_id
        self.queue = queue
        self.embedder = embedder  # None: a text-only model
        # Whether another decode worker is registered (discovery): a drain with none to take
        # the requests lets them finish here instead. None: assume there is.
        self._has_peers = has_peers
        self.metrics = metrics or DecodeMetrics(engine.stats, cfg.decode.disagg)
        self.receiver = KvReceiver(on_bytes=self.metrics.kv_bytes_received.inc,
                                   on_refused=self.metrics.kv_transfer_refused,
                                   segments=MappedSegments(cfg.decode.kv_shm_mapped_bytes))
        dc = cfg.decode
        # Moves: off this worker when it drains, onto it from draining ones.
        self.outbox = MoveOutbox(engine, worker_id, cfg.prefill.kv_chunk_bytes, dc.move_timeout_s,
                                 on_moved=self.metrics.request_moved,
                                 on_handed_back=self.receiver.cancel)
        self.kv_address = kv_address
        self._moves_in = MoveReceiver(engine, self.receiver, dc.move_timeout_s, self._spawn_abort,
                                      on_moved_in=self.metrics.move_received)
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._draining = False
        self._cleanup: set[asyncio.Task[None]] = set()
        # The remote-prefill decision's step-time model (predict policy with a queue only).
        self._step_model: StepModel | None = None
        # measured / predicted time to the first token, local and remote (DisaggConfig.
        # prediction_correction), and the requests whose remote prefill fell back to local
        # (their first token measures neither side)
        self._bias = {False: 1.0, True: 1.0}
        self._arrivals = ArrivalRate()  # requests taken in, for the decision's wait cost
        self._fell_back: set[str] = set()
        if queue is not None and cfg.decode.disagg.policy == "predict":
            self._step_model = step_model_for(cfg)
        spec = engine.kv_spec
        self._kv_bytes_per_token = (spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim
                                    * spec.dtype.itemsize)

    @property
    def num_inflight(self) -> int:
        return self._inflight

    @property
    def kv_address(self) -> str:
        """This worker's gRPC address as discovery publishes it: where prefill workers send
        KV and where the targets of its moved requests pull theirs."""
        return self.outbox.address

    @kv_address.setter
    def kv_address(self, address: str) -> None:
        self.outbox.address = address

    async def close(self) -> None:
        await self._moves_in.close()

    async def generate(self, request: GenerateRequest, images: tuple[PromptImage, ...] = (),
                       move_from: MoveSource | None = None) -> AsyncIterator[TokenOutput]:
        """Stream a request's outputs; this is where a request enters the worker, so it is
        checked here (InvalidRequestError) and nowhere further in. Raises Overloaded,
        Unavailable (draining, or no encoder produced its images), EngineDeadError, and
        RequestMoved when this worker drains with ``decode.drain: move``. Closing the
        iterator early aborts it (and the encoding of its images).

        ``images``: a multimodal prompt's images. They are encoded (here or by an encode
        worker) before the request is validated, and such a request prefills here.
        ``move_from``: a request moved off a draining worker (services/decode/move_in.py)."""
        if self._draining:
            raise Unavailable(f"decode worker {self.worker_id} is shutting down")
        refused = refusal(self.worker_id, self._inflight, self.engine.stats().num_running,
                          self.cfg.decode)
        if refused is not None:
            raise refused
        if images and self.embedder is None:
            raise InvalidRequest(f"decode worker {self.worker_id}'s model does not accept images",
                                 param="messages", code="image_input_not_supported")
        if not images:
            self.engine.validate(request)
        self._inflight += 1
        self._idle.clear()
        self._arrivals.arrived(time.monotonic())
        reserved = False
        predicted = 0.0  # the decision's predicted seconds to the first token (predict policy)
        decided_at = 0.0
        try:
            if images:
                request = await self._with_embeddings(request, images)
                self.engine.validate(request)
            if move_from is not None and not images:
                outs = self._moves_in.generate(request, move_from)
            else:
                decision = await self._decide(request)
                self.metrics.decisions.labels(decision.reason.value).inc()
                predicted = decision.remote_s if decision.remote else decision.local_s
                decided_at = time.monotonic()
                if decision.remote:
                    assert self.queue is not None
                    # NOTE: before any await: the next decision sees this one queued
                    self.queue.reserve(request.request_id, decision.effective_tokens)
                    reserved = True
                    outs = self._remote(request, decision)
                else:
                    self.metrics.prefill.labels(PrefillLocation.LOCAL.value).inc()
                    outs = self.engine.generate(request)
            async with aclosing(outs):
                try:
                    async for o in outs:
                        if predicted and o.token_ids:
                            self._measured(request.request_id, decision.remote,
                                           time.monotonic() - decided_at, predicted)
                            predicted = 0.0
                        yield o
                except RequestMoving as e:
                    source = self.outbox.source(e.request_id) if e.held else None
                    raise RequestMoved(f"decode worker {self.worker_id} is draining", source) from None
        finally:
            self._fell_back.discard(request.request_id)
            if reserved and self.queue is not None:
                self.queue.done(request.request_id)  # a stream that ended before its publish
            self._inflight -= 1
            if self._inflight == 0:
                self._idle.set()

    def _measured(self, rid: str, remote: bool, seconds: float, predicted: float) -> None:
        """A predict decision's first token: its error, and the side's correction."""
        if rid in self._fell_back:
            return
        self.metrics.prefill_predicted(remote, seconds, predicted)
        w = self.cfg.decode.disagg.prediction_correction
        if w:
            # NOTE: the prediction carried the correction: ratio x bias is what the model alone
            # was off by; clipped so that one outlier (a stall, a GC pause) cannot swing it
            raw = self._bias[remote] * min(max(seconds / predicted, 0.25), 4.0)
            self._bias[remote] = min(max((1 - w) * self._bias[remote] + w * raw, 0.25), 4.0)

    async def drain(self, grace_s: float) -> bool:
        """Refuse new requests; with ``decode.drain: move`` move the running ones off (and
        hand the others back to the processor), then wait up to what is left of ``grace_s``
        for what is still in flight; True if idle."""
        self._draining = True
        deadline = time.monotonic() + grace_s
        try:
            if self.cfg.decode.drain == "move" and await self._peers_to_move_to():
                await asyncio.wait_for(self.outbox.move_all(), grace_s)
            await asyncio.wait_for(self._idle.wait(), max(deadline - time.monotonic(), 0.0))
        except TimeoutError:
            return False
        return True

    async def _peers_to_move_to(self) -> bool:
        if self._has_peers is None:
            return True
        try:
            if await asyncio.wait_for(self._has_peers(), PEERS_TIMEOUT_S):
                return True
        except Exception as e:  # discovery unreachable: move anyway (failures replay)
            log.warning("decode worker %s: other decode workers unknown (%s); moving", self.worker_id, e)
            return True
        log.info("decode worker %s: no other decode worker to move to; letting requests finish",
                 self.worker_id)
        return False

    async def _with_embeddings(self, request: GenerateRequest, images: tuple[PromptImage, ...]
                               ) -> GenerateRequest:
        assert self.embedder is not None
        try:
            spans = await self.embedder.embed(request.request_id, images)
        except EncodeFailedError as e:
            raise Unavailable(str(e)) from None
        except ReceiveBuffersFullError as e:
            raise Overloaded(f"decode worker {self.worker_id}: image embedding buffers full ({e})",
                             code="overloaded") from None
        except ValueError as e:
            raise InvalidRequest(f"images: {e}", param="messages") from None
        return replace(request, images=spans)

    # ---- decision -------------------------------------------------------------------
    async def _decide(self, request: GenerateRequest) -> PrefillDecision:
        d = self.cfg.decode.disagg
        n = len(request.prompt_token_ids)
        queue = self.queue
        if request.sampling.prompt_logprobs is not None:
            # NOTE: prompt logprobs need every prompt position's logits, which a prefill
            # worker does not send (KV and one token): prefilled here.
            return PrefillDecision(False, DecisionReason.PROMPT_LOGPROBS, n)
        # NOTE: a multimodal request prefills here: its embeddings are in this process.
        if queue is None or not d.enabled or n <= d.max_local_prefill_length or request.images:
            # NOTE: local whatever the prefix hit: skip the step thread round trip to look it up.
            cfg = d if queue is not None else d.model_copy(update={"enabled": False})
            return decide_prefill(cfg, n, 0, 0, 0)
        cached = self.engine.prefix_hit_tokens(request.prompt_token_ids)
        depth = tokens = 0
        # NOTE: only pay the consumer-info round trip when the queue can change the answer.
        if n - cached > d.max_local_prefill_length:
            try:
                depth, tokens = await queue.depth(), queue.queued_tokens
            except Exception as e:  # NATS down or the queue gone: prefill here, never fail
                log.warning("prefill queue depth unknown (%s); prefilling locally", e)
                return decide_prefill(d.model_copy(update={"enabled": False}), n, cached, 0, 0)
        times = (worker_times(self.cfg, self._step_model, self.engine.stats(),
                              self._kv_bytes_per_token, self._bias[False], self._bias[True],
                              self._arrivals.rate(time.monotonic()))
                 if self._step_model is not None else None)
        return decide_prefill(d, n, cached, depth, tokens, times)

    # ---- remote path ----------------------------------------------------------------
    async def _remote(self, request: GenerateRequest, decision: PrefillDecision
                      ) -> AsyncIterator[TokenOutput]:
        assert self.queue is not None
        rid = request.request_id
        try:
            handle = await self.engine.begin_remote_prefill(request)
        except asyncio.CancelledError:
            self._spawn_abort(rid)
            raise
        if handle is None:  # its blocks do not fit now: the scheduler will wait for room
            self.queue.done(rid)  # never queued: its reservation goes now, not at the stream's end
            self._fallback(rid, FallbackReason.NO_BLOCKS)
            self.metrics.prefill.labels(PrefillLocation.LOCAL.value).inc()
            async with aclosing(self.engine.generate(request)) as outs:
                async for o in outs:
                    yield o
            return
        try:
            where = await self._await_remote_kv(request, handle, decision)
        except BaseException:
            # Cancelled (the call went away) while parked: abort, and let the engine free
            # the blocks; the stream is drained by a task this worker owns.
            self.receiver.cancel(rid)
            self.queue.done(rid)
            self._spawn_abort(rid)
            raise
        self.metrics.prefill.labels(where.value).inc()
        async with aclosing(self.engine.stream(rid)) as outs:
            async for o in outs:
                yield o

    async def _await_remote_kv(self, request: GenerateRequest, handle: RemotePrefillHandle,
                               decision: PrefillDecision) -> PrefillLocation:
        """Publish the job and wait for its KV; returns where the prefill ran in the end."""
        assert self.queue is not None
        rid = request.request_id
        spec = self.engine.kv_spec
        # NOTE: a fresh token per job: the receiver takes this request's KV only with it.
        token = new_token()
        fut = self.receiver.expect(rid, ExpectedKv(
            handle.first_block_to_fill, handle.num_blocks_to_fill,
            spec.block_range_shape(handle.num_blocks_to_fill), spec.dtype, token))
        timeout = self.cfg.decode.disagg.remote_prefill_timeout_s
        job = PrefillJob(
            request_id=rid, token_ids=tuple(request.prompt_token_ids), sampling=request.sampling,
            decode_worker_id=self.worker_id, kv_transfer_address=self.kv_address,
            first_block=handle.first_block_to_fill, num_blocks=handle.num_blocks_to_fill,
            deadline_unix_ms=int((time.time() + timeout) * 1000), decode_host_id=host_id(),
            transfer_token=token)
        delivered = False
        progress = self.queue.progress(rid)  # before the publish: the first report may be quick
        try:
            try:
                await self.queue.publish(job, decision.effective_tokens)
            except Exception as e:  # NATS down or the stream missing: prefill here
                log.warning("publishing remote prefill %s failed: %s", rid, e)
                return await self._give_up(rid, FallbackReason.PUBLISH_FAILED)
            if not await _wait_while_progressing(fut, progress, timeout):
                return await self._give_up(rid, FallbackReason.TIMEOUT)
            try:
                got: ReceivedKv = fut.result()
            except (KvTransferError, asyncio.CancelledError):
                return await self._give_up(rid, FallbackReason.BAD_KV)
            delivered = True  # the prefill worker acks (removes) the job itself
            try:
                await self.engine.complete_remote_prefill(rid, got.kv, got.first_token,
                                                          got.first_logprob)
            except RemoteKvError:  # the engine already sent it to local prefill
                got.release()
                self._fallback(rid, FallbackReason.BAD_KV)
                return PrefillLocation.LOCAL
            # NOTE: only once the engine copied it into its cache (not when cancelled
            # mid-call: the step thread may still be reading it).
            got.release()
            return PrefillLocation.REMOTE
        finally:
            self.receiver.cancel(rid)
            seq = self.queue.done(rid)
            if seq is not None and not delivered:
                # Cancelled or given up: take the job off the queue, or stop the prefill
                # worker running it, so the prompt is not prefilled twice.
                self._spawn(self.queue.retract(rid, seq), f"retract {rid}")

    async def _give_up(self, rid: str, reason: FallbackReason) -> PrefillLocation:
        self.receiver.cancel(rid)
        await self.engine.fail_remote_prefill(rid)
        self._fallback(rid, reason)
        return PrefillLocation.LOCAL

    def _fallback(self, rid: str, reason: FallbackReason) -> None:
        self._fell_back.add(rid)
        self.metrics.fallbacks.labels(reason.value).inc()

    def _spawn_abort(self, rid: str) -> None:
        self._spawn(self._abort_parked(rid), f"abort {rid}")

    def _spawn(self, coro, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._cleanup.add(task)
        task.add_done_callback(self._cleanup.discard)

    async def _abort_parked(self, rid: str) -> None:
        try:
            await self.engine.abort(rid)
            async for _ in self.engine.stream(rid):
                pass
        except Exception as e:  # engine already dead or the request gone: nothing to free
            log.debug("abort of parked %s: %s", rid, e)


async def _wait_while_progressing(fut: asyncio.Future, progress: asyncio.Event,
                                  silence_s: float) -> bool:
    """Wait for ``fut`` for as long as ``progress`` is set at least every ``silence_s``
    (a long prompt that keeps reporting is waited for; a lost job or a silent prefill worker
    is not). True when ``fut`` completed."""
    while True:
        progress.clear()
        beat = asyncio.ensure_future(progress.wait())
        try:
            done, _ = await asyncio.wait({fut, beat}, timeout=silence_s,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            beat.cancel()
        if fut in done:
            return True
        if not done:
            return False
