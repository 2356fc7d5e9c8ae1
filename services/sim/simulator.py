"""The discrete-event loop: a cluster's requests, router and engines on a virtual clock.

What runs is production code: the ``Router`` (``router.replicas`` of them, each fed every
worker's events and load, requests spread round-robin, each one's in-flight updates reaching
the others ``sim.inflight_delay_s`` later; its radix index fed through ``KvIngest``, its
load tracker and selection), one ``LLMEngine`` per worker (scheduler, block pool, KV
cache manager) over a ``SimRunner``, the decode worker's admission bound
(``services.decode.admission``), its remote-prefill decision
(``services.decode.disagg.decide_prefill``) and the load sample it publishes
(``services.decode.load``). What is modelled: the forward (``StepModel``), the JetStream
work queue (``_PrefillQueue``: FIFO, a job counted in the depth until its KV is
delivered; it goes to the prefill worker with a free slot whose pull request is oldest,
``_puller``), the KV transfer (latency + bytes over a
link) and the frontend + processor path (``sim.request_overhead_s``).

Timing of one engine step: the engine steps (schedules, "computes", updates) when the
step starts, and its outputs and KV events reach the rest of the cluster when the step's
modelled time has passed. Events at the same instant run in this order: step completions,
KV deliveries, load ticks, then requests.

Engine calls (a request's admission, the decode worker's prefix lookup and
``begin_remote_prefill``, a KV import) run as ``AsyncEngine`` runs them: on the step
thread, between steps (``_call``). One made while the worker waits for a batch runs when
that batch completes, so a request reaching a busy worker waits for it, and the two calls
of a remote-prefill decision wait for one step each; their outputs (a remote prefill's
first token) leave with the next step's.

Fast path: a decode worker whose next steps are certain to be the same batch of decodes
(``Scheduler.decode_run_length``) and that no event can reach before they end does them at
once (``Scheduler.advance_decodes``) and records their tokens in one go. Nothing outside
the worker can observe it in between (load samples, routes and deliveries all end a run),
so every figure equals stepping one by one (``fast_forward=False``; tests check it).
"""

from __future__ import annotations

import bisect
import gc
import heapq
import math
import time
from collections import deque
from collections.abc import Callable, Coroutine
from collections.abc import Sequence as Seq
from dataclasses import dataclass, replace
from operator import sub
from typing import Any, TypeVar

import numpy as np

from services.api.kv_events import KvEvent
from services.api.outputs import FinishReason, TokenOutput
from services.api.route import RequestPhase, RouteRequest
from services.api.sampling import SamplingParams
from services.api.wire import InflightUpdate, RawEventBatch, WorkerLoad, raw_event
from services.common.config import ClusterConfig
from services.common.discovery import Registration
from services.common.hashing import BlockHash, block_hashes
from services.decode.admission import refusal
from services.decode.arrival_rate import ArrivalRate
from services.decode.disagg import decide_prefill, worker_times
from services.decode.load import worker_load
from services.disagg.prefill_queue import PULL_WAIT_S
from services.engine.engine import LLMEngine
from services.engine.request import GenerateRequest
from services.engine.scheduler import InvalidRequestError
from services.engine.sequence import Sequence
from services.router.errors import NoWorkersAvailable
from services.router.router import Router
from services.sim.records import (
    GapSamples,
    HitSample,
    RequestRecord,
    SimResult,
    WorkerSample,
    WorkerTotals,
)
from services.sim.requests import SimRequest
from services.sim.runner import SimRunner
from services.sim.traces import token_list
from services.steptime.model import BatchShape, StepModel, holds_rows

T = TypeVar("T")

DECODE, PREFILL = "decode", "prefill"
# Event kinds, in the order they run at one instant.
_STEP, _KV, _TICK, _SEND = 0, 1, 2, 3
_SESSION = 1  # every simulated worker's KV event session (none restarts)
# Engine calls a worker's step thread runs between steps (``_call``).
_ADD, _GENERATE, _REMOTE, _IMPORT, _MOVE_IN = 0, 1, 2, 3, 4
# At most this many decode steps in one fast-forwarded run, and the most of a run's steps
# a simulated engine learns its speed from (later ones change nothing the first taught).
_MAX_RUN = 1 << 16
_LEARNT = 64
# Load samples kept for the plots, about (all workers together).
_MAX_WORKER_SAMPLES = 200_000

Progress = Callable[[float, int], None]
# A prompt's tokens: a list, or a u32 array (``PromptMaker.make``: hashed as it is, made the
# engine's list once by ``token_list``).
TokenMaker = Callable[[SimRequest], list[int] | np.ndarray]


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine that never suspends (the router without a NATS connection)."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise RuntimeError("a simulated call suspended: it needs a transport the simulator has not")


class _CyclicGcOff:
    """The cyclic GC off for a run. NOTE: a run holds millions of long-lived objects (index
    nodes, block hashes) and makes no reference cycles (a trace-hour leaves nothing for
    gc.collect() to find), so the collector would only rescan live objects: a tenth of a
    run even at the router's raised thresholds. After it, freeze() + unfreeze() move what
    the run made to the oldest generation unscanned (else the next young collection scans
    all of it). A finished Simulation is itself garbage in cycles (the index's nodes, the
    callbacks into it), which only a full collection frees: the next run starts with one
    once runs in this process have left more than ``COLLECT_AFTER`` such objects."""

    COLLECT_AFTER = 1_000_000
    unscanned = 0  # tracked objects runs in this process moved there since the last collect

    def __enter__(self) -> None:
        if _CyclicGcOff.unscanned > self.COLLECT_AFTER:
            gc.collect()
            _CyclicGcOff.unscanned = 0
        self.was_enabled = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc: object) -> None:
        _CyclicGcOff.unscanned += gc.get_count()[0]  # net objects made while it was off
        gc.freeze()
        gc.unfreeze()
        if self.was_enabled:
            gc.enable()


@dataclass(slots=True)
class _Job:
    """A remote prefill in the queue (what a PrefillJob carries, less the transport)."""

    request_id: str
    decode: _Worker
    tokens: list[int]
    hashes: Seq[BlockHash] | None
    first_block: int
    num_blocks: int
    effective_tokens: int
    prefill: _Worker | None = None
    published_s: float = 0.0


@dataclass(slots=True)
class _Run:
    """A fast-forwarded run in a worker's pipe, for the load ticks inside it: when each of
    its steps would have been composed, each sequence's computed tokens and blocks before
    it, and the pool's blocks in use before it. ``load``: the worker's load sample as a
    tick took it in the run (its blocks aside), kept until the engine may change: anything
    that steps or calls the worker's engine goes through ``_between_steps`` or ``_compose``,
    which drop it."""

    composed_at: list[float]
    seqs: list[tuple[int, int]]
    used: int
    load: WorkerLoad | None = None


class _StepNoise:
    """Mean-1 lognormal factors of relative standard deviation ``sd`` (sim.step_noise),
    drawn in blocks from one seeded generator: a run's draws follow its events' order."""

    BLOCK = 4096

    def __init__(self, sd: float, seed: int) -> None:
        self._sigma = math.sqrt(math.log1p(sd * sd))
        self._rng = np.random.default_rng(seed)
        self._left: list[float] = []

    def next(self) -> float:
        if not self._left:
            s = self._sigma
            self._left = (np.exp(s * self._rng.standard_normal(self.BLOCK) - s * s / 2)).tolist()
        return self._left.pop()


class _PrefillQueue:
    """The JetStream work queue as decode workers see it: ``depth`` counts jobs pending and
    taken but not acked (acked when their KV is delivered); queued tokens are per decode
    worker (services/disagg/prefill_queue.py)."""

    def __init__(self) -> None:
        self.pending: deque[_Job] = deque()
        self.unacked = 0
        self.tokens: dict[str, int] = {}

    def depth(self) -> int:
        return len(self.pending) + self.unacked

    def reserve(self, worker_id: str, tokens: int) -> None:
        """A remote decision's tokens, counted from the decision on, before its publish
        (PrefillQueue.reserve)."""
        self.tokens[worker_id] = self.tokens.get(worker_id, 0) + tokens

    def publish(self, job: _Job) -> None:
        """Its tokens were reserved at the decision."""
        self.pending.append(job)

    def acked(self, job: _Job) -> None:
        self.unacked -= 1
        self.tokens[job.decode.id] -= job.effective_tokens


class _Worker:
    """One simulated worker process: its engine, and what its step in flight carries."""

    def __init__(self, wid: str, role: str, cfg: ClusterConfig, model: StepModel) -> None:
        self.id = wid
        self.role = role
        self.runner = SimRunner(cfg.engine, model)
        self.events: list[list] = []  # raw KV events not yet delivered to the router
        on_event = self._on_event if role == DECODE else None
        self.engine = LLMEngine(self.runner, cfg.engine.model_copy(update={"overlap": False}),
                                [cfg.engine.mock.eos_token_id], wid, on_kv_event=on_event,
                                step_model=model, prefill_worker=role == PREFILL)
        # Steps composed and not yet completed on the device, their end times, when the
        # device is free, and the KV events the last of them delivers.
        self.in_pipe = 0
        self.ends: deque[float] = deque()
        self.device_free = 0.0
        self.tail_events: list[list] = []
        self.run: _Run | None = None  # the run of decodes in the pipe, if one is
        self.calls: list[tuple] = []  # engine calls waiting for the step thread
        self.in_calls = False  # applying calls: a call they make waits for the next step
        self.carry: list[TokenOutput] = []  # calls' outputs, dispatched with the next step's
        self.pull_at = 0.0  # prefill workers: when their pull request was (re)issued
        self.adding = 0  # prompt tokens of local decisions whose add is a call away
        self.dirty = True  # changed since its last load sample
        self.last_load: WorkerLoad | None = None
        self.inflight = 0  # requests it holds (DecodeWorker._inflight)
        self.arrivals = ArrivalRate()  # requests taken in (DecodeWorker._arrivals)
        self.free_slots = cfg.prefill.max_concurrent_jobs  # prefill workers
        self.totals = WorkerTotals(wid, role, kv_blocks_total=cfg.engine.num_kv_blocks)
        # Leaving (drain_worker): out of discovery, finishing or moving its work.
        self.draining = False

    def _on_event(self, ev: KvEvent) -> None:
        self.events.append(raw_event(ev))


class Simulation:
    """One run; ``run()`` returns its SimResult. See the module docstring."""

    def __init__(self, cfg: ClusterConfig, requests: list[SimRequest], model: StepModel,
                 tokens: TokenMaker, oracle_hit_rate: float = 0.0,
                 progress: Progress | None = None, fast_forward: bool = True) -> None:
        if cfg.decode.replicas < 1:
            raise ValueError("the simulation needs decode.replicas >= 1")
        self.cfg = cfg
        self.requests = sorted(requests, key=lambda r: (r.arrival_s, r.index))
        self.model = model
        self.tokens = tokens
        self.oracle = oracle_hit_rate
        self.progress = progress
        self.fast_forward = fast_forward
        # The overlapped loop composes a batch while the one before it computes; the engines
        # here step one batch at a time and are simply run one batch ahead of their device.
        overlap = cfg.engine.overlap
        self.depth = 2 if (model.overlap_pays if overlap == "auto" else overlap) else 1
        # Workers on one host share its CPUs with other work (sim.host_cpus,
        # sim.host_background; 0 CPUs: each worker has cores of its own).
        self.cpus = cfg.sim.host_cpus
        self.threads = cfg.engine.threads
        self.background = cfg.sim.host_background
        # NOTE: its own stream, apart from the routers' (seeded from sim.seed too).
        self.noise = (_StepNoise(cfg.sim.step_noise, cfg.sim.seed + 7919)
                      if cfg.sim.step_noise > 0 else None)
        self.row_tokens = model.row_tokens
        self.now = 0.0
        self.block_size = cfg.engine.block_size
        # router.replicas production routers, each fed every worker's KV events and load;
        # requests go to them round-robin (as the processor picks), and an in-flight update
        # one makes reaches the others sim.inflight_delay_s later (over NATS when deployed).
        n = cfg.router.replicas
        self.routers = [Router(cfg, replica=i, seed=cfg.sim.seed + i, clock=self._clock,
                               share=self._sharer(i) if n > 1 else None, keep_ttft_errors=True)
                        for i in range(n)]
        self.router = self.routers[0]
        self._rr = 0
        self._home: dict[str, Router] = {}  # request -> the replica that routed it (n > 1)
        # (due, replica, update): shared in-flight updates on their way; FIFO as the delay
        # is constant. Not in _other: they reach no worker, so they end no fast-forward run.
        self._shares: deque[tuple[float, Router, InflightUpdate]] = deque()
        self.decoders = [_Worker(f"decode-{i}", DECODE, cfg, model)
                         for i in range(cfg.decode.replicas)]
        self.prefillers = [_Worker(f"prefill-{i}", PREFILL, cfg, model)
                           for i in range(cfg.prefill.replicas)]
        self.by_id = {w.id: w for w in self.decoders}
        for router in self.routers:
            for w in self.decoders:
                router.ingest.mark_synced(w.id, _SESSION)
                router.worker_joined(Registration(DECODE, w.id, f"sim:{w.id}"))
        # Remote prefill exists where prefill workers do (a decode worker opens the queue).
        self.queue = _PrefillQueue() if self.prefillers else None
        disagg = cfg.decode.disagg
        self._disagg = disagg if self.queue is not None else disagg.model_copy(
            update={"enabled": False})
        self.records: dict[str, RequestRecord] = {}
        self.jobs: dict[str, _Job] = {}
        self.gaps = GapSamples()
        self.worker_samples: list[WorkerSample] = []
        self.hit_samples: list[HitSample] = []
        # (time, kind, seq, payload): step completions, and everything else but requests
        # from the trace (sorted already) and load ticks (one instant at a time).
        self._steps_heap: list[tuple[float, int, int, Any]] = []
        self._other: list[tuple[float, int, int, Any]] = []
        self._seq = 0
        self._next = 0  # next request of self.requests to send
        self._waiting_on: dict[int, list[SimRequest]] = {}  # index -> requests after it
        self._done = 0
        self._steps = 0
        self._ff_steps = 0
        interval = cfg.sim.load_interval_s
        self._interval = interval
        self._next_tick = 0.0
        last = self.requests[-1].arrival_s if self.requests else 0.0
        ticks = max(1.0, last / interval)
        self._sample_every = max(1, math.ceil(len(self.decoders) * ticks / _MAX_WORKER_SAMPLES))
        self._tick_no = 0
        for r in self.requests:
            if r.after is not None:
                self._waiting_on.setdefault(r.after, []).append(r)
        # Workers joining (not ready yet), leaving (draining) and gone: only a planned run
        # (services/sim/planned.py) has any.
        self.starting: list[_Worker] = []
        self.leaving: list[_Worker] = []
        self.gone: list[_Worker] = []
        self.moved: set[str] = set()  # decode requests moved off a draining worker
        self.reprefilled: set[str] = set()  # moved ones whose KV did not fit: prefilled again
        self.leaked_blocks = 0  # KV blocks a drained worker still held when it left

    def _clock(self) -> float:
        return self.now

    def _sharer(self, i: int) -> Callable[[InflightUpdate], None]:
        def share(u: InflightUpdate) -> None:
            due = self.now + self.cfg.sim.inflight_delay_s
            for j, other in enumerate(self.routers):
                if j != i:
                    self._shares.append((due, other, u))
        return share

    def _ingest(self, batch: RawEventBatch) -> None:
        """KV events reach every replica (each subscribes to every worker's)."""
        for router in self.routers:
            router.ingest.handle_batch(batch)

    # ---- the loop --------------------------------------------------------------------
    def run(self) -> SimResult:
        with _CyclicGcOff():
            return self._run()

    def _run(self) -> SimResult:
        t0 = time.perf_counter()
        reqs, steps, other, shares = self.requests, self._steps_heap, self._other, self._shares
        n = len(reqs)
        events = 0
        while True:
            while self._next < n and reqs[self._next].after is not None:
                self._next += 1  # sent when the request it follows ends
            t_arr = reqs[self._next].arrival_s if self._next < n else math.inf
            t_step = steps[0][0] if steps else math.inf
            t_other = other[0][0] if other else math.inf
            t_share = shares[0][0] if shares else math.inf
            if t_step == t_other == t_arr == math.inf:
                break  # shared updates left over change nothing any more
            # At one instant: step completions, deliveries, shared in-flight updates, the
            # load tick, then requests.
            if t_step <= t_other and t_step <= t_arr and t_step <= self._next_tick and t_step <= t_share:
                self.now, _, _, payload = heapq.heappop(steps)
                self._step_done(*payload)
            elif (t_other <= t_arr and t_other <= self._next_tick and t_other <= t_share
                  and other[0][1] == _KV):
                self.now, _, _, payload = heapq.heappop(other)
                self._kv_delivered(*payload)
            elif t_share <= t_arr and t_share <= self._next_tick and t_share <= t_other:
                self.now, router, u = shares.popleft()
                router.apply_inflight(u)
            elif self._next_tick <= t_other and self._next_tick <= t_arr:
                self.now = self._next_tick
                self._tick()
            elif t_other <= t_arr:
                self.now, _, _, payload = heapq.heappop(other)
                if isinstance(payload, _Routed):
                    self._route(payload.request_id, payload.tokens, payload.request)
                elif isinstance(payload, Later):
                    payload.fn()
                else:
                    self._send(payload)
            else:
                self.now = t_arr
                self._next += 1
                self._send(reqs[self._next - 1])
            events += 1
            if self.progress is not None and events % 4096 == 0:
                self.progress(self.now, self._done)
        end = self.now
        while shares:  # the last frees on their way: every replica ends with none in flight
            self.now, router, u = shares.popleft()
            router.apply_inflight(u)
        self.now = end  # they reach routers only: the run ended with its last request
        if self.progress is not None:
            self.progress(self.now, self._done)
        return self._result(time.perf_counter() - t0)

    def _push(self, t: float, kind: int, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self._steps_heap if kind == _STEP else self._other,
                       (t, kind, self._seq, payload))

    def at(self, t: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` at virtual time ``t`` (with the requests' kind of events): the hook a
        planner and the scaling of workers use."""
        self._push(t, _SEND, Later(fn))

    @property
    def unfinished(self) -> int:
        """Requests of the replay not yet ended."""
        return len(self.requests) - self._done

    def _horizon(self) -> float:
        """The earliest instant something from outside may reach a worker: the next
        request or delivery, and, while requests wait for others to end, any step completion
        (it may send one). Load ticks do not end a run: they sample it (``_run_load``)."""
        h = math.inf
        if self._next < len(self.requests):
            h = self.requests[self._next].arrival_s
        if self._other:
            h = min(h, self._other[0][0])
        if (self._waiting_on or self.leaving) and self._steps_heap:
            # a step may send a request, or end a drain that moves requests elsewhere
            h = min(h, self._steps_heap[0][0])
        for p in self.prefillers:  # a prefill that ends sends its KV to a decode worker
            if p.ends and p.ends[0] < h:
                h = p.ends[0]
        return h

    # ---- requests --------------------------------------------------------------------
    def _send(self, req: SimRequest) -> None:
        rid = f"r{req.index}"
        rec = RequestRecord(req.index, self.now, req.input_len, req.output_len)
        self.records[rid] = rec
        tokens = self.tokens(req)
        rec.prompt_tokens = len(tokens)
        overhead = self.cfg.sim.request_overhead_s
        if overhead > 0:
            # NOTE: routed when it reaches the router: its state then decides.
            self._push(self.now + overhead, _SEND, _Routed(rid, tokens, req))
            return
        self._route(rid, tokens, req)

    def _route(self, rid: str, made: list[int] | np.ndarray, req: SimRequest) -> None:
        rec = self.records[rid]
        router = self.routers[self._rr % len(self.routers)]
        self._rr += 1
        # NOTE: hashed once, as the processor hashes a prompt to route it: the router takes
        # the local hashes, the engine the chained ones.
        hashes = block_hashes(made, self.block_size)
        tokens = made if isinstance(made, list) else token_list(made)
        try:
            resp = run_sync(router.route(RouteRequest(
                rid, tokens, [h.local_hash for h in hashes])))
        except NoWorkersAvailable as e:
            self._fail(rec, None, str(e))
            return
        if len(self.routers) > 1:
            self._home[rid] = router
        w = self.by_id[resp.worker_id]
        rec.worker = w.id
        w.totals.requests += 1
        eng = w.engine
        refused = refusal(w.id, w.inflight, eng.stats().num_running, self.cfg.decode)
        request = GenerateRequest(rid, tokens, SamplingParams(
            temperature=0.0, max_tokens=req.output_len, ignore_eos=True), block_hashes=hashes)
        if refused is None:
            try:
                eng.validate(request)
            except InvalidRequestError as e:
                refused = e
        if refused is not None:
            self._fail(rec, None, str(refused))
            self._router_update(rid, RequestPhase.FINISHED)
            return
        w.inflight += 1
        w.dirty = True
        self._call(w, (_GENERATE, request))

    def _router_update(self, rid: str, phase: RequestPhase) -> None:
        """A request's first token or end, as the processor reports it. NOTE: deployed, it
        is one NATS publish every replica applies; here the replica that routed the request
        applies it at once (as with one replica) and the others after
        sim.inflight_delay_s, so each sees a request's add before its free."""
        if len(self.routers) == 1:
            run_sync(self.router.update(rid, phase))
            return
        home = self._home.pop(rid) if phase is RequestPhase.FINISHED else self._home[rid]
        run_sync(home.update(rid, phase))  # applies it, and shares it with the others

    def _fail(self, rec: RequestRecord, w: _Worker | None, error: str) -> None:
        rec.error = error
        rec.end_s = self.now
        self._end(rec, w)

    def _end(self, rec: RequestRecord, w: _Worker | None) -> None:
        self._done += 1
        if w is not None:
            w.inflight -= 1
            w.dirty = True
        followers = self._waiting_on.pop(rec.index, None)
        if followers:
            for r in followers:
                self._push(max(r.arrival_s, self.now), _SEND, r)

    # ---- the step thread: engine calls run between steps --------------------------------
    def _call(self, w: _Worker, call: tuple) -> None:
        """An engine call from the worker's asyncio side (``AsyncEngine.call``, ``generate``).
        The step thread runs calls between two steps: one made while a step waits for a
        batch in flight runs when that batch completes (``_step_done``), else at once."""
        w.calls.append(call)
        if not w.in_pipe and not w.in_calls:
            self._between_steps(w)

    def _between_steps(self, w: _Worker) -> None:
        """What ``AsyncEngine._run`` does between steps: apply the calls made meanwhile, then
        compose. The calls' outputs are dispatched with the next step's, when that step
        returns: at once unless it waits for a batch (the serial loop's own; the
        overlapped loop's one in flight before the calls). Calls the calls make (the next
        of a request's) wait for the step they were made during, when there is one."""
        if w.run is not None:
            w.run.load = None
        while True:
            calls, w.calls = w.calls, []
            outs: list[TokenOutput] = []
            waited = w.in_pipe > 0
            if calls:
                w.in_calls = True
                for c in calls:
                    o = self._run_call(w, c)
                    if o is not None:
                        outs.append(o)
                w.in_calls = False
                w.dirty = True
            self._compose(w)
            if outs:
                if waited if self.depth == 2 else w.in_pipe > 0:
                    w.carry += outs
                else:
                    for o in outs:
                        self._output(w, o)
            if w.draining and not w.in_pipe and not w.calls:
                self._try_leave(w)
            if w.in_pipe or not w.calls:
                return

    def _run_call(self, w: _Worker, call: tuple) -> TokenOutput | None:
        kind, eng = call[0], w.engine
        if kind == _ADD:
            eng.add_request(call[1])
            if len(call) > 2:  # a local decision's: no longer submitted-only
                w.adding -= call[2]
        elif kind == _GENERATE:
            # the decode worker's Generate: where to prefill (DecodeWorker._decide)
            request = call[1]
            tokens = request.prompt_token_ids
            d, n, queue = self._disagg, len(tokens), self.queue
            w.arrivals.arrived(self.now)
            if not (d.enabled and n > d.max_local_prefill_length):
                eng.add_request(request)
                return None
            cached = eng.prefix_hit_tokens(tokens)
            depth = queued = 0
            if queue is not None and n - cached > d.max_local_prefill_length:
                depth, queued = queue.depth(), queue.tokens.get(w.id, 0)
            times = None
            if d.policy == "predict":
                stats = eng.stats()
                if w.adding:  # AsyncEngine.stats: prompts submitted count as pending
                    stats = replace(stats, num_prefill_tokens_pending=stats.num_prefill_tokens_pending
                                    + w.adding)
                limit = eng.scheduler.chunk_limit
                if limit is not None:
                    # NOTE: the speed ``_learn`` teaches its scheduler, which a real engine's
                    # stats carry (the simulated runner's steps take no real time to measure);
                    # read at once on this one thread, so no snapshot.
                    stats = replace(stats, step_speed=limit.speed)
                times = worker_times(self.cfg, self.model, stats, self.cfg.sim.kv_bytes_per_token,
                                     arrival_rate=w.arrivals.rate(self.now))
            decision = decide_prefill(d, n, cached, depth, queued, times)
            # NOTE: begin_remote_prefill or generate is a second call: after the next step;
            # the decision's tokens count from now on (DecodeWorker.generate, AsyncEngine)
            if decision.remote:
                assert queue is not None
                queue.reserve(w.id, decision.effective_tokens)
                self._call(w, (_REMOTE, request, decision))
            else:
                w.adding += n
                self._call(w, (_ADD, request, n))
        elif kind == _REMOTE:
            request, decision = call[1], call[2]
            handle = eng.begin_remote_prefill(request)
            assert self.queue is not None
            if handle is None:  # its blocks do not fit now: prefill here (a further call)
                self.queue.tokens[w.id] -= decision.effective_tokens
                self._call(w, (_ADD, request))
                return None
            rid = request.request_id
            self.records[rid].remote = True
            job = _Job(rid, w, list(request.prompt_token_ids), request.block_hashes,
                       handle.first_block_to_fill,
                       handle.num_blocks_to_fill, decision.effective_tokens)
            job.published_s = self.now
            self.jobs[rid] = job
            self.queue.publish(job)
            self._dispatch()
        elif kind == _IMPORT:
            return eng.complete_remote_prefill(call[1], call[2], call[3])
        else:  # _MOVE_IN: a request moved here with its KV (drain_worker)
            self._move_in(w, call[1], call[2], call[3])
        return None

    def _move_in(self, w: _Worker, rid: str, tokens: list[int], remaining: int) -> None:
        """Import a moved request's KV and go on decoding it. Its last streamed token is
        the one the import appends (its KV is not computed yet): that output is not
        streamed again. Blocks that do not fit: prefilled here again (counted)."""
        eng = w.engine
        request = GenerateRequest(rid, tokens[:-1], SamplingParams(
            temperature=0.0, max_tokens=remaining + 1, ignore_eos=True))
        handle = eng.begin_remote_prefill(request)
        if handle is None:
            self.reprefilled.add(rid)
            eng.add_request(request)
            return
        kv = w.runner.export_kv(range(handle.num_blocks_to_fill))
        eng.complete_remote_prefill(rid, kv, tokens[-1])

    # ---- engines ---------------------------------------------------------------------
    def _compose(self, w: _Worker) -> None:
        """Step the engine for the batches its device runs next: with the overlapped loop
        (``self.depth`` 2) a batch is composed while the one before it computes, as
        ``LLMEngine`` does it; else when the device is free."""
        eng = w.engine
        if w.run is not None:
            w.run.load = None
        self._flush(w)
        if w.draining and w.role == DECODE and self._movable(w):
            return  # its requests move at the end of the step in flight (_try_leave)
        while w.in_pipe < self.depth and eng.has_schedulable():
            # NOTE: calls waiting or outputs to dispatch end the next step: no run then.
            if (self.fast_forward and w.role == DECODE and not w.calls and not w.carry
                    and self._fast_forward(w)):
                continue
            outs = eng.step()
            if eng.last_batch_size == 0:
                return  # nothing could run (no blocks or seats): idle until something changes
            dt = w.runner.last_seconds
            if self.cpus or self.noise is not None:
                dt = self._scaled(w, w.runner.last_shape, dt)
            self._enqueue(w, [dt], outs, None)

    def _enqueue(self, w: _Worker, dts: list[float], outs: list[TokenOutput] | None,
                 run: tuple[list[Sequence], list[float]] | None) -> None:
        """Put steps just composed on the worker's device; their outputs and KV events
        reach the cluster when the last of them completes."""
        end = max(self.now, w.device_free)
        for dt in dts:
            end += dt
        w.device_free = end
        w.in_pipe += len(dts)
        w.ends.append(end)
        events, w.events = w.events, []
        w.tail_events = events
        self._push(end, _STEP, (w, dts, outs, run, events))

    def _fast_forward(self, w: _Worker) -> bool:
        sched = w.engine.scheduler
        tok = w.runner.token
        k = sched.decode_run_length(_MAX_RUN, tok)
        if k < 1:
            return False
        horizon = self._horizon()
        share = 1.0
        if self.cpus:
            # NOTE: the run ends when another worker's device may fall idle: the share its
            # steps are composed at holds only while the same workers step.
            share, first_free = self._share(w)
            horizon = min(horizon, first_free)
        running = list(sched.running)
        b = len(running)
        ctx = 0
        for s in running:
            ctx += s.num_tokens
        model = self.model
        t = max(self.now, w.device_free)
        times: list[float] = []
        dts: list[float] = []
        dt = model.step_seconds(BatchShape(0, 0, b, ctx)) * share
        draw = self.noise.next if self.noise is not None else None
        factors: list[float] = []  # the first steps' noise factors, which the engine learns
        if model.reads_decode_context or draw is not None:
            reads = model.reads_decode_context
            base = dt
            for j in range(k):
                if j and reads:
                    base = model.step_seconds(BatchShape(0, 0, b, ctx + b * j)) * share
                dt = base
                if draw is not None:
                    f = draw()
                    if len(factors) < _LEARNT:
                        factors.append(f)
                    dt *= f
                if t + dt > horizon:
                    break
                t += dt
                times.append(t)
                dts.append(dt)
        else:  # NOTE: the same sums, in the same order, as the loop above (no per-step call)
            append = times.append
            for _ in range(k):
                t_next = t + dt
                if t_next > horizon:
                    break
                t = t_next
                append(t)
            dts = [dt] * len(times)
        # NOTE: one at a time, the step after the run is composed when its last but one
        # step completes; a load tick before the run's end would see it: end the run first.
        while self.depth == 2 and len(times) >= 2 and self._tick_between(times[-2], times[-1]):
            times.pop()
            dts.pop()
        if not times:
            return False
        n = len(times)
        if draw is not None:
            self._learn(w, BatchShape(0, 0, b, ctx), [share * f for f in factors[:min(n, _LEARNT)]])
        elif self.cpus:
            self._learn(w, BatchShape(0, 0, b, ctx), [share] * min(n, _LEARNT))
        # When each step of the run is composed one at a time: as the batches ahead of it
        # complete (a load tick in between samples the state as of then, ``_run_load``).
        free = self.depth - w.in_pipe  # >= 1: steps composed at once
        composed = [self.now] * min(free, n)
        if n > free:
            composed += (list(w.ends) + times)[:n - free]
        w.run = _Run(composed,
                     [(s.num_computed_tokens, len(s.block_table)) for s in running],
                     w.engine.pool.num_used)
        sched.advance_decodes(n, tok)
        self._enqueue(w, dts, None, (running, times))
        return True

    def _stepping(self) -> list[_Worker]:
        """The workers that may have steps on their device (serving or draining)."""
        return self.decoders + self.prefillers + self.leaving

    def _share(self, w: _Worker) -> tuple[float, float]:
        """How much slower than its model a step ``w`` composes now runs: the runnable threads,
        the engine threads of the workers stepping now (``w``'s among them) and the host's
        other work, over its CPUs; at least 1. A step keeps the share it started with. Also
        when the first of the other workers stepping now may fall idle (inf: none steps)."""
        now, busy, first_free = self.now, 1, math.inf
        for o in self._stepping():
            if o is not w and o.device_free > now:
                busy += 1
                first_free = min(first_free, o.device_free)
        return max(1.0, (busy * self.threads + self.background) / self.cpus), first_free

    def _scaled(self, w: _Worker, shape: BatchShape, dt: float) -> float:
        """A step's time on the shared host (``_share``) and with its scatter
        (sim.step_noise), which its engine learns."""
        r = self._share(w)[0] if self.cpus else 1.0
        if self.noise is not None:
            r *= self.noise.next()
        self._learn(w, shape, [r])
        return dt * r

    def _learn(self, w: _Worker, shape: BatchShape, ratios: list[float]) -> None:
        """What a real engine under an ITL target learns of steps of ``shape`` taking
        ``ratios`` x their model's time (``LLMEngine._observe_speed``): it plans its chunks at
        that speed and scatter. The ratio alone matters: the predicted time stands for both."""
        limit = w.engine.scheduler.chunk_limit
        if limit is None:
            return
        prefill = shape.prefill_tokens > 0
        rows = holds_rows(shape, 1, self.row_tokens)
        for r in ratios:
            limit.speed.observe(prefill, 1.0, r, rows)

    def _tick_between(self, a: float, b: float) -> bool:
        """Whether a load tick falls in [a, b) (ticks follow each other every interval)."""
        t = self._next_tick
        while t < a:
            t += self._interval
        return t < b

    def _run_load(self, w: _Worker, run: _Run, now: float) -> WorkerLoad:
        """The load sample of a worker whose run of decodes is composed only partly by
        ``now`` (one at a time, the steps after ``now`` would not be yet): its blocks then."""
        j = bisect.bisect_right(run.composed_at, now)
        bs = self.block_size
        used = run.used
        for computed, blocks in run.seqs:
            need = -(-(computed + j) // bs) - blocks
            if need > 0:
                used += need
        ld = run.load
        if ld is None:  # NOTE: the engine is as at the last tick otherwise: same stats
            ld = run.load = worker_load(w.id, w.engine.stats(), now)
        return WorkerLoad(ld.worker_id, used, ld.kv_blocks_total, ld.requests_running,
                          ld.requests_waiting, ld.active_prefill_tokens, now)

    def _step_done(self, w: _Worker, dts: list[float], outs: list[TokenOutput] | None,
                   run: tuple[list[Sequence], list[float]] | None, events: list[list]) -> None:
        w.in_pipe -= len(dts)
        w.ends.popleft()
        if w.carry:
            carried, w.carry = w.carry, []
            for o in carried:
                self._output(w, o)
        tot = w.totals
        for dt in dts:
            tot.busy_s += dt
        tot.steps += len(dts)
        if run is None:
            assert outs is not None
            self._steps += 1
            for o in outs:
                self._output(w, o)
        else:
            self._ff_steps += len(dts)
            self._ran(run[0], run[1])
            w.run = None
        used = w.engine.pool.num_used
        if used > tot.peak_kv_blocks_used:
            tot.peak_kv_blocks_used = used
        if events and not w.draining:
            self._ingest(RawEventBatch(w.id, _SESSION, events))
        w.dirty = True
        self._between_steps(w)

    def _ran(self, seqs: list[Sequence], times: list[float]) -> None:
        """Record a fast-forwarded run's tokens: what its steps' outputs would have."""
        # NOTE: GapSamples.add inlined (a run adds one gap per sequence and per step).
        values, counts = self.gaps.values, self.gaps.counts
        recs = [self.records[s.request_id] for s in seqs]
        k = len(times)
        start, last = times[0], times[-1]
        for rec in recs:
            first = start - rec.last_token_s
            values.append(first)
            counts.append(1)
            if first > rec.max_gap_s:
                rec.max_gap_s = first
            rec.last_token_s = last
            rec.tokens_out += k
        steps = list(map(sub, times[1:], times[:-1]))
        values += steps
        counts += [len(seqs)] * len(steps)
        widest = max(steps, default=0.0)  # the run's largest step gap: every sequence had it
        for rec in recs:
            if widest > rec.max_gap_s:
                rec.max_gap_s = widest

    def _output(self, w: _Worker, o: TokenOutput) -> None:
        if w.role == PREFILL:
            if o.finished:
                self._prefilled(w, o)
            return
        rec = self.records[o.request_id]
        now = self.now
        if self.reprefilled and o.token_ids and o.request_id in self.reprefilled:
            # moved without its KV: the re-prefill's first token was streamed already
            self.reprefilled.discard(o.request_id)
            o = replace(o, token_ids=o.token_ids[1:])
        if o.token_ids:
            if rec.tokens_out == 0:
                rec.first_token_s = now
                rec.cached_tokens = o.num_cached_tokens
                self._router_update(o.request_id, RequestPhase.PREFILLED)
            else:
                gap = now - rec.last_token_s
                self.gaps.add(gap)
                if gap > rec.max_gap_s:
                    rec.max_gap_s = gap
            rec.last_token_s = now
            rec.tokens_out += len(o.token_ids)
        if o.finished:
            self._router_update(o.request_id, RequestPhase.FINISHED)
            rec.end_s = now
            if o.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
                rec.error = o.error or f"finished with {o.finish_reason}"
            else:
                rec.completed = True
                w.totals.prompt_tokens += o.num_prompt_tokens
                w.totals.hit_tokens += o.num_cached_tokens
            self._end(rec, w)

    def _flush(self, w: _Worker) -> None:
        """Deliver the KV events the worker's engine emitted outside a step: now, or after
        those of its steps in flight (event ids reach the router in order)."""
        if not w.events:
            return
        if w.draining:  # out of discovery: the routers forgot it
            w.events = []
            return
        if w.in_pipe:
            w.tail_events.extend(w.events)
        else:
            self._ingest(RawEventBatch(w.id, _SESSION, w.events))
        w.events = []

    # ---- remote prefill --------------------------------------------------------------
    def _dispatch(self) -> None:
        """Prefill workers with free job slots pull the queue's head jobs."""
        queue = self.queue
        if queue is None:
            return
        while queue.pending:
            p = self._puller()
            if p is None:
                return
            job = queue.pending.popleft()
            queue.unacked += 1
            p.free_slots -= 1
            p.pull_at = self.now  # its fetch returned with the job: it pulls again at once
            job.prefill = p
            self.records[job.request_id].prefill_worker = p.id
            p.totals.requests += 1
            self._call(p, (_ADD, GenerateRequest(
                job.request_id, job.tokens, SamplingParams(temperature=0.0, max_tokens=1),
                export_kv_from_block=job.first_block, block_hashes=job.hashes)))

    def _puller(self) -> _Worker | None:
        """The prefill worker whose pull request comes first in the consumer's waiting list
        (served in the order issued), None when none has a free slot. A worker with free
        slots holds one request, issued when its last fetch returned (with jobs, or empty
        every ``PULL_WAIT_S``) or when a slot freed up (PrefillWorker._pull_loop)."""
        best, best_at, now = None, math.inf, self.now
        for p in self.prefillers:
            if p.free_slots > 0 and not p.draining:
                at = p.pull_at + math.floor((now - p.pull_at) / PULL_WAIT_S) * PULL_WAIT_S
                if at < best_at:
                    best, best_at = p, at
        return best

    def _prefilled(self, p: _Worker, o: TokenOutput) -> None:
        job = self.jobs[o.request_id]
        p.totals.prompt_tokens += o.num_prompt_tokens
        p.totals.hit_tokens += o.num_cached_tokens
        sim = self.cfg.sim
        nbytes = job.num_blocks * self.block_size * sim.kv_bytes_per_token
        delay = sim.kv_transfer_latency_s + nbytes / (sim.kv_transfer_gbps * 1e9)
        self._push(self.now + delay, _KV, (job, o.kv, o.token_ids[0]))

    def _kv_delivered(self, job: _Job, kv: Any, first_token: int) -> None:
        assert self.queue is not None and job.prefill is not None
        del self.jobs[job.request_id]
        self.queue.acked(job)
        p = job.prefill
        if p.free_slots == 0:
            p.pull_at = self.now  # a slot frees: its pull loop fetches again
        p.free_slots += 1
        self._call(job.decode, (_IMPORT, job.request_id, kv, first_token))
        if p.draining:
            self._try_leave(p)
        self._dispatch()

    # ---- workers joining and leaving (a planned run: services/sim/planned.py) ---------
    def add_worker(self, role: str, ready_s: float) -> str:
        """Start a worker; it serves ``ready_s`` from now (model load, registration)."""
        n = len([w for w in self._all_workers() if w.role == role])
        w = _Worker(f"{role}-{n}", role, self.cfg, self.model)
        self.starting.append(w)
        self.at(self.now + ready_s, lambda: self._ready(w))
        return w.id

    def _all_workers(self) -> list[_Worker]:
        return self.decoders + self.prefillers + self.starting + self.leaving + self.gone

    def _ready(self, w: _Worker) -> None:
        self.starting.remove(w)
        if w.role == DECODE:
            self.decoders.append(w)
            self.by_id[w.id] = w
            for router in self.routers:
                router.ingest.mark_synced(w.id, _SESSION)
                router.worker_joined(Registration(DECODE, w.id, f"sim:{w.id}"))
            return
        self.prefillers.append(w)
        self._prefill_count()
        w.pull_at = self.now
        if self.queue is None:  # the first prefill worker: remote prefill starts
            self.queue = _PrefillQueue()
            self._disagg = self.cfg.decode.disagg
        self._dispatch()

    def _prefill_count(self) -> None:
        """The decode workers' remote-prefill prediction counts the prefill workers
        (``worker_times``): it sees the count now serving, as discovery would tell it."""
        p = self.cfg.prefill.model_copy(update={"replicas": len(self.prefillers)})
        self.cfg = self.cfg.model_copy(update={"prefill": p})

    def drain_worker(self, wid: str) -> bool:
        """Take a ready worker out of service without losing a request: it leaves discovery
        at once; a prefill worker pulls no more jobs and leaves when its last is delivered; a
        decode worker finishes the prefills it holds (local, or remote KV on its way), then
        moves every running request to another decode worker as a KV transfer
        (``sim.kv_transfer_*``) and leaves. False (nothing done) for the last decode worker."""
        w = next((x for x in self.decoders + self.prefillers if x.id == wid), None)
        if w is None:
            raise KeyError(f"no ready worker {wid!r}")
        if w.role == DECODE:
            if len(self.decoders) < 2:
                return False
            self.decoders.remove(w)
            for router in self.routers:
                router.worker_left(w.id)
        w.draining = True
        self.leaving.append(w)
        self._try_leave(w)
        return True

    def _movable(self, w: _Worker) -> bool:
        """Every request a draining decode worker holds has streamed its first token, and
        none moved here is being prefilled again (its KV would leave half computed)."""
        sched = w.engine.scheduler
        if sched.waiting or sched.parked or w.calls:
            return False
        records, again = self.records, self.reprefilled
        for s in (*sched.running, *sched.ready):
            if records[s.request_id].tokens_out == 0 or s.request_id in again:
                return False
        return True

    def _try_leave(self, w: _Worker) -> None:
        if w.in_pipe or w.calls or w.carry:
            return
        if w.role == PREFILL:
            if w.free_slots < self.cfg.prefill.max_concurrent_jobs:
                return  # jobs of its own still computing or on their way
            self.prefillers.remove(w)
            self._prefill_count()
        else:
            if not self._movable(w):
                self._compose(w)  # finishing its prefills
                return
            sched = w.engine.scheduler
            for seq in list(sched.running) + list(sched.ready):
                self._move_out(w, seq)
        self.leaving.remove(w)
        self.gone.append(w)
        self.leaked_blocks += w.engine.pool.num_used
        w.engine.check_integrity()

    def _move_out(self, w: _Worker, seq: Sequence) -> None:
        rid = seq.request_id
        rec = self.records[rid]
        tokens = list(seq.token_ids)
        w.engine.abort(rid)
        w.events = []
        w.inflight -= 1
        self.moved.add(rid)
        sim = self.cfg.sim
        nbytes = -(-(len(tokens) - 1) // self.block_size) * self.block_size * sim.kv_bytes_per_token
        delay = sim.kv_transfer_latency_s + nbytes / (sim.kv_transfer_gbps * 1e9)
        self.at(self.now + delay, lambda: self._arrive(rid, tokens, rec.output_tokens - rec.tokens_out))

    def _arrive(self, rid: str, tokens: list[int], remaining: int) -> None:
        """A moved request's KV reaches the decode worker with the most free blocks."""
        target = max(self.decoders, key=lambda d: d.engine.pool.num_free)
        target.inflight += 1
        target.dirty = True
        self.records[rid].worker = target.id
        self._call(target, (_MOVE_IN, rid, tokens, remaining))

    # ---- load ticks ------------------------------------------------------------------
    def _tick(self) -> None:
        now = self.now
        keep = self._tick_no % self._sample_every == 0
        self._tick_no += 1
        routers = self.routers
        prompt = hit = 0
        for w in self.decoders:
            run = w.run
            if run is not None and now < run.composed_at[-1]:
                ld = w.last_load = self._run_load(w, run, now)
                w.dirty = True  # its sample changes as the run goes on
            elif w.dirty or w.last_load is None:
                ld = w.last_load = worker_load(w.id, w.engine.stats(), now)
                w.dirty = False
            else:
                ld = w.last_load
            if keep:
                self.worker_samples.append(WorkerSample(
                    now, w.id, ld.requests_running, ld.requests_waiting, ld.kv_blocks_used,
                    ld.kv_blocks_total, ld.active_prefill_tokens))
                sched = w.engine.scheduler
                prompt += sched.prompt_tokens_total
                hit += sched.prefix_hit_tokens_total
            for router in routers:
                router.apply_load(ld)
        if keep:
            self.hit_samples.append(HitSample(now, prompt, hit))
        # NOTE: with nothing due before the next event, the skipped ticks would only
        # republish the same samples: jump to the last one before it.
        nxt = now + self._interval
        if not any(w.in_pipe for w in self.decoders) and not any(p.in_pipe for p in self.prefillers):
            due = self._other[0][0] if self._other else math.inf
            if self._next < len(self.requests):
                due = min(due, self.requests[self._next].arrival_s)
            if due == math.inf:
                due = nxt
            if due > nxt:
                nxt = now + math.floor((due - now) / self._interval) * self._interval
        self._next_tick = nxt

    # ---- result ----------------------------------------------------------------------
    def _result(self, wall_s: float) -> SimResult:
        records = sorted(self.records.values(), key=lambda r: r.index)
        for r in records:
            if r.completed:
                r.end_s = r.end_s or r.last_token_s
        return SimResult(
            records=records, gaps=self.gaps,
            workers=[w.totals for w in self.decoders + self.prefillers + self.leaving
                     + self.gone],
            worker_samples=self.worker_samples, hit_samples=self.hit_samples,
            oracle_hit_rate=self.oracle, slo=dict(self.cfg.sim.slo), duration_s=self.now,
            wall_s=wall_s, steps=self._steps, fast_forward_steps=self._ff_steps,
            ttft_predictions=[e for r in self.routers if r.ttft is not None
                              for e in r.ttft.errors or ()])


@dataclass(frozen=True, slots=True)
class Later:
    """Something to do at an instant of the virtual clock (``Simulation.at``)."""

    fn: Callable[[], None]


@dataclass(frozen=True, slots=True)
class _Routed:
    """A request on its way through the frontend and processor to the router."""

    request_id: str
    tokens: list[int] | np.ndarray
    request: SimRequest


def simulate(cfg: ClusterConfig, requests: list[SimRequest], model: StepModel,
             tokens: TokenMaker, oracle_hit_rate: float = 0.0, progress: Progress | None = None,
             fast_forward: bool = True) -> SimResult:
    """Replay ``requests`` through the cluster ``cfg`` describes; see ``Simulation``."""
    return Simulation(cfg, requests, model, tokens, oracle_hit_rate, progress,
                      fast_forward).run()
