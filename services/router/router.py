"""The router part: `route(RouteRequest) -> RouteResponse` over the index, load and selection.

Lifecycle: ``async with Router(cfg) as r`` (or start()/close()) connects to NATS (or uses a
given connection), watches discovery for decode workers, ingests their KV events and load
metrics, and shares in-flight request adds/frees with the other replicas. Callers report a
request's first token and its end with ``update(request_id, phase)`` so its load is released,
or (deployed processors) publish them on the shared in-flight subject, which every replica
applies.

A request routes only to workers that discovery lists as live decode workers; KV events and
load from any other worker id are dropped (a worker that registers later is synced by a dump).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import random
import time
import uuid
from array import array
from collections.abc import Callable, Sequence
from typing import assert_never

import nats.errors
from nats.aio.msg import Msg

from services.api.route import RequestPhase, RouteRequest, RouteResponse
from services.api.wire import (
    InflightOp,
    InflightUpdate,
    WireError,
    WorkerLoad,
    decode_inflight,
    decode_load,
    encode_inflight,
)
from services.common.config import ClusterConfig, RouterMode
from services.common.discovery import Discovery, Registration
from services.common.hashing import local_block_hashes
from services.common.nats_client import NatsClient, Subjects, connect
from services.common.service import cancel_and_wait
from services.router.errors import InvalidRouteRequest, NoWorkersAvailable
from services.router.indexer import RadixIndex
from services.router.ingest import KvIngest
from services.router.load import LoadTracker
from services.router.metrics import RouterMetrics
from services.router.selection import Candidate, select_worker
from services.router.ttft import TtftCandidate, TtftPredictor, select_by_ttft
from services.steptime.profile import step_model_for

log = logging.getLogger(__name__)

DECODE_ROLE = "decode"
# A bound on the blocks one route may name (16M tokens at 16 per block), far past any
# context length: the router's work per route is O(blocks), so a caller cannot make one
# route arbitrarily expensive. Deliberately not engine config, which a part may override.
MAX_ROUTE_BLOCKS = 1 << 20


def _router_mode(value: object) -> RouterMode:
    """``router.mode`` as a RouterMode. The config parser checks it already; this catches a
    config built around it (``model_copy(update=...)``, ``model_construct``)."""
    try:
        return RouterMode(value)
    except ValueError:
        raise ValueError(f"router.mode {value!r} is not one of "
                         f"{', '.join(repr(m.value) for m in RouterMode)}") from None


# The cyclic GC's thresholds for a process holding a large index (tune_gc_for_index).
INDEX_GC_THRESHOLDS = (50_000, 20, 100)


def tune_gc_for_index() -> None:
    """Raise the cyclic GC thresholds for a router *process* (serve and the bench call it).

    The index is millions of long-lived node objects; with the default thresholds (700, 10,
    10) the collector rescans them so often that ingest runs at less than half speed (measured:
    ~0.43M vs ~1.1M blocks/s for 1M blocks). The index creates no garbage cycles on its hot
    paths (pruned nodes drop their parent link), so collecting rarely costs little memory.
    Process-wide, hence not done by ``Router`` itself (tests host many parts in one process).
    """
    gc.set_threshold(*INDEX_GC_THRESHOLDS)


class Router:
    def __init__(
        self,
        cfg: ClusterConfig,
        replica: int = 0,
        metrics: RouterMetrics | None = None,
        seed: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        share: Callable[[InflightUpdate], None] | None = None,
        keep_ttft_errors: bool = False,
    ) -> None:
        """``clock``: what in-flight expiry, load staleness and TTFT are measured by (the
        simulator gives its virtual clock). ``share``: takes each in-flight update this
        replica makes, for the other replicas, where they are not reached over NATS (the
        simulator's replicas, which apply it with ``apply_inflight``). ``keep_ttft_errors``:
        keep every (predicted, actual) TTFT pair in ``ttft.errors`` (the simulator's report)."""
        self.cfg = cfg
        self.replica = replica
        self.mode = _router_mode(cfg.router.mode)
        # Unique per process so a replica can ignore its own in-flight broadcasts.
        self.instance = f"router-{replica}-{uuid.uuid4().hex[:8]}"
        self.subjects = Subjects(cfg.namespace)
        self.metrics = metrics if metrics is not None else RouterMetrics()
        self.index = RadixIndex()
        rc = cfg.router
        self.load = LoadTracker(cfg.engine.block_size, rc.inflight_ttl_s, rc.load_stale_s, clock)
        self.metrics.indexed_blocks.set_function(self.index.num_blocks)
        # ttft mode only: the others read no step-time model (a profile file to load).
        self.ttft: TtftPredictor | None = None
        if self.mode is RouterMode.TTFT:
            self.ttft = TtftPredictor(
                step_model_for(cfg), cfg.engine.block_size, cfg.engine.max_num_batched_tokens,
                rc.ttft_bias_alpha, clock, self.metrics.ttft_error_seconds,
                self.metrics.ttft_error_ratio, keep_ttft_errors)
        self._workers: dict[str, Registration] = {}
        # Workers whose last load sample shows a full waiting queue
        # (decode.max_waiting_requests): routed to only when every worker is full.
        self._saturated: set[str] = set()
        self._worker_ids: list[str] = []  # sorted keys of _workers, kept off the route path
        self._rng = random.Random(seed)
        self._rr = 0
        self._share = share
        self._nc: NatsClient | None = None
        self._owns_nc = False
        self.ingest = KvIngest(
            None, self.subjects, self.index, self.metrics, rc.dump_timeout_s, rc.max_buffered_batches,
            max_blocks_per_worker=rc.max_blocks_per_worker, dump_retry_max_s=rc.dump_retry_max_s,
        )
        self._subs: list = []
        self._watch_task: asyncio.Task[None] | None = None
        self.discovery: Discovery | None = None

    # ---- lifecycle -------------------------------------------------------------------
    async def start(self, nc: NatsClient | None = None) -> None:
        if nc is None:
            # NOTE: no_echo: the router would only drop its own in-flight updates (3 per
            # request) after receiving and decoding them.
            nc = await connect(self.cfg.nats, name=self.instance, no_echo=True)
            self._owns_nc = True
        self._nc = nc
        await self.ingest.start(nc)
        self._subs.append(await nc.subscribe(self.subjects.load_all, cb=self._on_load))
        self._subs.append(await nc.subscribe(self.subjects.router_inflight, cb=self._on_inflight))
        self.discovery = await Discovery.open(nc, self.cfg.namespace, self.cfg.discovery)
        self._watch_task = asyncio.create_task(self._watch(), name="router discovery watch")
        self._watch_task.add_done_callback(_log_death)

    async def close(self) -> None:
        if self._watch_task is not None:
            await cancel_and_wait(self._watch_task)
            self._watch_task = None
        await self.ingest.close()
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except nats.errors.Error:
                pass
        self._subs.clear()
        if self._owns_nc and self._nc is not None:
            await self._nc.close()
        self._nc = None

    async def __aenter__(self) -> Router:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def workers(self) -> dict[str, Registration]:
        """Live decode workers from discovery, by instance id."""
        return dict(self._workers)

    # ---- routing ---------------------------------------------------------------------
    async def route(self, req: RouteRequest) -> RouteResponse:
        """Pick a worker for ``req`` (see selection.py for the kv cost). Raises
        InvalidRouteRequest for a malformed request, NoWorkersAvailable with no workers."""
        t0 = time.perf_counter()
        if not req.request_id:
            raise InvalidRouteRequest("request_id is empty")
        hashes = self._hashes(req)
        workers = self._worker_ids
        if not workers:
            raise NoWorkersAvailable("no decode workers registered in discovery")
        if req.exclude_workers:
            excluded = set(req.exclude_workers)
            workers = [w for w in workers if w not in excluded]
            if not workers:
                raise NoWorkersAvailable(
                    f"no decode worker left: all {len(self._worker_ids)} registered are excluded")
        if self._saturated:
            # NOTE: when all are full the request still goes to one, which refuses it
            # (RESOURCE_EXHAUSTED -> 429): the worker, not a load sample, has the last word.
            workers = [w for w in workers if w not in self._saturated] or workers
        scores = self.index.find_matches(hashes).scores
        n = len(hashes)
        mode = self.mode
        rc = self.cfg.router
        if mode is RouterMode.TTFT:
            assert self.ttft is not None
            views = self.load.ttft_views(workers)
            tcands = [
                TtftCandidate(w, scores.get(w, 0), prefill, active, running, free, unused)
                for w, (prefill, active, running, free), unused
                in zip(workers, views, self._unused_blocks(workers, views), strict=True)
            ]
            sel = select_by_ttft(self.ttft, tcands, n, rc.affinity_band, self._rng,
                                 rc.eviction_weight)
            worker = sel.worker_id
            self.ttft.routed(req.request_id, worker, sel.predicted_s)
        elif mode is RouterMode.KV:
            views = self.load.ttft_views(workers)
            cands = [
                Candidate(w, scores.get(w, 0), prefill, active, unused)
                for w, (prefill, active, _, _), unused
                in zip(workers, views, self._unused_blocks(workers, views), strict=True)
            ]
            worker = select_worker(
                cands, n, rc.overlap_weight, rc.temperature, self._rng, rc.eviction_weight
            ).worker_id
        elif mode is RouterMode.ROUND_ROBIN:
            worker = workers[self._rr % len(workers)]
            self._rr += 1
        elif mode is RouterMode.RANDOM:
            worker = self._rng.choice(workers)
        else:
            assert_never(mode)
        overlap = min(scores.get(worker, 0), n)
        await self._track(InflightUpdate(self.instance, InflightOp.ADD, req.request_id, worker, n, n - overlap))
        self.metrics.decisions.labels(worker).inc()
        self.metrics.overlap_blocks.observe(overlap)
        self.metrics.route_seconds.observe(time.perf_counter() - t0)
        return RouteResponse(
            worker_id=worker,
            overlap_blocks=overlap,
            request_blocks=n,
            prefix_hit_rate=overlap / n if n else 0.0,
            address=self._workers[worker].address,
        )

    def _hashes(self, req: RouteRequest) -> Sequence[int]:
        """The request's local block hashes: ``local_hashes`` checked (u64 ints, at most
        MAX_ROUTE_BLOCKS, as many as ``token_ids`` has full blocks when both are given), or
        ``token_ids`` hashed here. InvalidRouteRequest otherwise."""
        bs = self.cfg.engine.block_size
        if req.local_hashes:
            if len(req.local_hashes) > MAX_ROUTE_BLOCKS:
                raise InvalidRouteRequest(
                    f"{len(req.local_hashes)} local_hashes: more than {MAX_ROUTE_BLOCKS} blocks")
            # NOTE: array("Q") both checks every hash is an int in [0, 2**64) (~12-25 us for
            # 500 blocks, a tenth of hashing their tokens) and copies them for find_matches.
            try:
                hashes = array("Q", req.local_hashes)
            except (OverflowError, TypeError) as e:
                raise InvalidRouteRequest(f"local_hashes are not u64 block hashes: {e}") from None
            if req.token_ids and len(hashes) != len(req.token_ids) // bs:
                raise InvalidRouteRequest(
                    f"{len(hashes)} local_hashes for {len(req.token_ids)} token_ids: expected one "
                    f"per full block of {bs} tokens ({len(req.token_ids) // bs})")
            return hashes
        if not req.token_ids:
            raise InvalidRouteRequest("neither token_ids nor local_hashes given")
        if len(req.token_ids) > MAX_ROUTE_BLOCKS * bs:
            raise InvalidRouteRequest(
                f"{len(req.token_ids)} token_ids: more than {MAX_ROUTE_BLOCKS} blocks of {bs}")
        try:
            return local_block_hashes(req.token_ids, bs)
        except (OverflowError, ValueError, TypeError) as e:
            raise InvalidRouteRequest(f"token_ids are not u32 token ids: {e}") from None

    async def update(self, request_id: str, phase: RequestPhase) -> None:
        """Report a routed request's first token (PREFILLED) or its end (FINISHED)."""
        if not request_id:
            raise InvalidRouteRequest("request_id is empty")
        op = InflightOp.PREFILLED if phase is RequestPhase.PREFILLED else InflightOp.FREE
        await self._track(InflightUpdate(self.instance, op, request_id))

    def apply_inflight(self, u: InflightUpdate) -> None:
        """Apply an in-flight update, this replica's own or another's."""
        if u.op is InflightOp.ADD:
            self.load.add(u.request_id, u.worker_id, u.prompt_blocks, u.prefill_blocks)
        elif u.op is InflightOp.PREFILLED:
            self.load.prefilled(u.request_id)
            if self.ttft is not None:
                self.ttft.first_token(u.request_id)
        else:
            self.load.free(u.request_id)
            if self.ttft is not None:
                self.ttft.forget(u.request_id)

    def _unused_blocks(self, workers: list[str], views: list[tuple[int, int, int, int]]) -> list[int]:
        """Each worker's KV blocks that hold nothing, neither a live request nor a cached
        prefix (selection.py): its total (free + active) less the blocks the index holds for
        it; -1 where its free blocks are unknown (no fresh metrics)."""
        cached = self.index.num_blocks
        return [max(free + active - cached(w), 0) if free >= 0 else -1
                for w, (_, active, _, free) in zip(workers, views, strict=True)]

    async def _track(self, u: InflightUpdate) -> None:
        self.apply_inflight(u)
        if self._share is not None:
            self._share(u)
        if self._nc is not None:
            try:
                await self._nc.publish(self.subjects.router_inflight, encode_inflight(u))
            except nats.errors.Error as e:  # the other replicas catch up via metrics
                log.warning("could not share in-flight update: %s", e)

    # ---- NATS inputs -----------------------------------------------------------------
    async def _on_load(self, msg: Msg) -> None:
        try:
            load = decode_load(msg.data)
        except WireError as e:
            self.metrics.bad_messages.labels("load").inc()
            log.warning("dropping bad load message on %s: %s", msg.subject, e)
            return
        self.apply_load(load)

    def apply_load(self, load: WorkerLoad) -> None:
        """Take in a decode worker's load sample (from NATS, or the simulator's tick)."""
        if load.worker_id not in self._workers:
            # NOTE: only registered decode workers' load is kept (the tracker would grow by
            # one entry per made-up id); a worker's first samples may precede its join.
            self.metrics.events_ignored.labels("load", "unregistered").inc()
            return
        self.load.update_metrics(load)
        if load.requests_waiting >= self.cfg.decode.max_waiting_requests:
            self._saturated.add(load.worker_id)
        else:
            self._saturated.discard(load.worker_id)

    async def _on_inflight(self, msg: Msg) -> None:
        try:
            u = decode_inflight(msg.data)
        except WireError as e:
            self.metrics.bad_messages.labels("inflight").inc()
            log.warning("dropping bad in-flight update: %s", e)
            return
        if u.replica_id != self.instance:
            self.apply_inflight(u)

    # ---- discovery -------------------------------------------------------------------
    def worker_joined(self, reg: Registration) -> None:
        """A decode worker is live (the discovery watch calls this; so does the bench)."""
        self._workers[reg.instance_id] = reg
        self._worker_ids = sorted(self._workers)
        self.ingest.worker_joined(reg.instance_id)
        self.metrics.workers.set(len(self._workers))

    def worker_left(self, worker_id: str) -> None:
        """A decode worker is gone: forget its blocks, load and in-flight requests."""
        self._workers.pop(worker_id, None)
        self._saturated.discard(worker_id)
        self._worker_ids = sorted(self._workers)
        self.ingest.worker_left(worker_id)
        self.load.remove_worker(worker_id)
        if self.ttft is not None:
            self.ttft.worker_left(worker_id)
        self.metrics.workers.set(len(self._workers))

    async def _watch(self) -> None:
        assert self.discovery is not None
        generation = 0
        confirmed: dict[str, int] = {}  # worker -> last watch generation that announced it
        while True:
            generation += 1
            if generation > 1 and self._workers:
                # A restarted watch replays live keys as joins but cannot report leaves that
                # happened while it was down: drop workers it has not re-announced in 2 TTLs.
                asyncio.get_running_loop().call_later(
                    2 * self.cfg.discovery.ttl_s, self._drop_unconfirmed,
                    set(self._workers), confirmed, generation,
                )
            try:
                async for ev in self.discovery.watch(DECODE_ROLE):
                    if ev.kind == "join":
                        confirmed[ev.registration.instance_id] = generation
                        self.worker_joined(ev.registration)
                    else:
                        self.worker_left(ev.registration.instance_id)
            except (TimeoutError, nats.errors.Error) as e:
                log.warning("discovery watch failed (%s); restarting", e)
                await asyncio.sleep(0.5)

    def _drop_unconfirmed(self, workers: set[str], confirmed: dict[str, int], generation: int) -> None:
        for w in workers:
            if confirmed.get(w, 0) < generation and w in self._workers:
                self.worker_left(w)


def _log_death(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("%s died: %r", task.get_name(), task.exception())
