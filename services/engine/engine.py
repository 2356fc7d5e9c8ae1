"""The synchronous engine: a scheduler and a model runner, stepped by one thread.

Not thread-safe: every call must come from the same thread (AsyncEngine's step thread).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from services.api.kv_events import KvEvent
from services.api.outputs import TokenLogprob, TokenOutput
from services.common.config import EngineConfig
from services.engine.batch import PendingOutput, RunnerOutput, ScheduledBatch, batch_shape
from services.engine.block_pool import BlockPool, BlockPoolIntegrityError
from services.engine.kv_cache_manager import KvCacheManager
from services.engine.move import MoveHold
from services.engine.remote_prefill import RemotePrefillHandle
from services.engine.request import GenerateRequest
from services.engine.runner.base import ModelRunner, RunnerInfo
from services.engine.scheduler import InvalidRequestError, Scheduler
from services.engine.timings import EngineTimings
from services.steptime.chunk import DeviceSpeed, chunk_limit_for, measures_speed

if TYPE_CHECKING:
    from services.engine.grammar.batch_mask import BatchMask, MaskBuilder, MaskFiller
    from services.engine.grammar.compiler import GrammarCompiler
    from services.engine.grammar.stats import GrammarStats
    from services.steptime.model import StepModel


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_running: int
    num_waiting: int  # includes sequences parked for a remote prefill
    num_parked: int
    kv_blocks_used: int  # referenced by a live request
    kv_blocks_cached: int  # unreferenced, kept for prefix hits
    kv_blocks_free: int
    kv_blocks_total: int
    prompt_tokens_total: int
    prefix_cache_hit_tokens_total: int
    num_preemptions_total: int
    # Step and request-phase histograms, live (written by the step thread).
    timings: EngineTimings
    # Tokens this engine still has to prefill: waiting sequences' tokens less their prefix-
    # cache hits (as of when they queued) and running ones' uncomputed prompt tokens (parked
    # remote prefills excluded: another worker prefills them). Scheduler.prefill_tokens_pending.
    num_prefill_tokens_pending: int = 0
    # Scheduler.decode_tokens_left: (tokens left under max_tokens, running without one)
    decode_tokens_left: int = 0
    num_running_unbounded: int = 0
    # The grammar compiler's live counters (structured output); None without one.
    grammar: GrammarStats | None = None
    # What computes the steps (device, dtype, quantization, CPU kernel set).
    runner: RunnerInfo = RunnerInfo()
    # Measured / modelled seconds of its steps (a copy of its DeviceSpeed); None: no ITL
    # target, or a runner whose steps take no real time.
    step_speed: DeviceSpeed | None = None
    # The runner's ModelRunner.row_step_tokens (the decode worker's prediction chunks by it)
    row_step_tokens: int = 0


class LLMEngine:
    """``step()`` = schedule, execute, update. Requests enter with ``add_request``.

    With ``cfg.overlap`` (and a runner that can ``launch``) a step schedules and launches
    batch N+1, then reads back and applies batch N while N+1 computes: at most one batch
    is in flight ahead of the one being processed (docs/engine.md "The overlapped loop").

    ``step_model``: the device's step-time model for ``engine.itl_target_ms`` (the
    simulator's device); None: the one ``engine.step_model`` names.

    The pool size is the runner's ``kv_spec.num_blocks`` (the runner owns the KV tensor);
    the max length is ``min(cfg.max_model_len or runner.max_model_len, runner.max_model_len)``.
    """

    def __init__(
        self,
        runner: ModelRunner,
        cfg: EngineConfig,
        eos_token_ids: Iterable[int],
        worker_id: str = "",
        on_kv_event: Callable[[KvEvent], None] | None = None,
        grammar: GrammarCompiler | None = None,
        step_model: StepModel | None = None,
        prefill_worker: bool = False,
    ) -> None:
        spec = runner.kv_spec
        if spec.block_size != cfg.block_size:
            raise ValueError(f"runner block_size {spec.block_size} != engine.block_size "
                             f"{cfg.block_size}")
        max_len = min(cfg.max_model_len or runner.max_model_len, runner.max_model_len)
        self.timings = EngineTimings()
        # Indexed by StepKind: one lookup per step, nothing allocated.
        self._step_seconds = self.timings.step_seconds
        self.runner = runner
        self.cfg = cfg
        self.pool = BlockPool(spec.num_blocks, spec.block_size, on_kv_event, worker_id)
        self.kv = KvCacheManager(self.pool)
        self.scheduler = Scheduler(
            self.kv,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_model_len=max_len,
            long_prefill_token_threshold=cfg.long_prefill_token_threshold,
            fifo_prefill=cfg.prefill_order == "fifo" or (cfg.prefill_order == "auto"
                                                         and prefill_worker),
            chunk_limit=(limit := chunk_limit_for(cfg, runner.info.device, step_model,
                                                  row_tokens=runner.row_step_tokens)),
            vocab_size=runner.vocab_size,
            eos_token_ids=eos_token_ids,
            kv_exporter=runner.export_kv,
            kv_importer=runner,
            grammar=grammar if runner.supports_grammar else None,
            timings=self.timings,
        )
        # Structured output: the compiler (None: requests with a grammar are refused) and
        # the builder of each batch's allowed-token mask.
        self.grammar = self.scheduler.grammar
        self._masks: MaskBuilder | None = None
        self._filler: MaskFiller | None = None  # the overlapped loop's (made with it)
        self._next_mask: BatchMask | None = None  # the launched batch's, to fill once N's tokens are in
        if self.grammar is not None:
            from services.engine.grammar.batch_mask import MaskBuilder

            self._masks = MaskBuilder(cfg.max_num_seqs, runner.vocab_size,
                                      pin=runner.pins_host_memory, stats=self.grammar.stats)
        # The ITL target's measure of this device against its step model: each step,
        # predicted and timed (None: no target, or steps that take no real time).
        self.speed = limit.speed if limit is not None and measures_speed(runner.info.device) else None
        self._step_cost = limit.cost if limit is not None else None  # the prediction of a step
        self._flight_start = 0.0  # when the batch in flight was launched
        self._last_done = 0.0  # when the last batch read back completed
        # Sequences the last step launched (or, launching none, read back); 0 = it did
        # nothing, so a caller may wait for new work.
        self.last_batch_size = 0
        self._no_output = RunnerOutput([])
        self.overlap = runner.supports_overlap and (
            runner.overlap_pays if cfg.overlap == "auto" else cfg.overlap)
        runner.reserve_future_slots(self.scheduler.num_future_slots)
        # (batch, its pending result, its fence ticket): launched, not yet read back
        self._in_flight: tuple[ScheduledBatch, PendingOutput, int] | None = None
        self.num_steps = 0
        self.scheduler_seconds = 0.0  # wall time in schedule() + update(), for the bubble

    # ---- requests -------------------------------------------------------------------
    def validate(self, request: GenerateRequest) -> None:
        """Raise InvalidRequestError if the request can never be served (reads config only).
        The one check of a request: callers run it at their entry, before ``add_request``."""
        self.scheduler.validate(request)
        spec = request.sampling.structured
        if spec is not None:
            if self.grammar is None:
                raise InvalidRequestError(
                    f"request {request.request_id!r}: structured output is not available on "
                    "this worker (it needs the torch runner and the model's tokenizer)")
            try:
                self.grammar.check(spec)  # compiles once per spec, off the step thread
            except ValueError as e:
                raise InvalidRequestError(f"request {request.request_id!r}: {e}") from None

    def add_request(self, request: GenerateRequest) -> None:
        """Queue a request that passed ``validate``; InvalidRequestError if its id is live."""
        self.scheduler.add(request)
        self.runner.request_added(request)

    def abort(self, request_id: str) -> TokenOutput | None:
        """Abort a live request (waiting, running or parked); its final output, or None."""
        out = self.scheduler.abort(request_id)
        self.runner.request_gone(request_id)
        return out

    def step(self) -> list[TokenOutput]:
        if self.overlap:
            return self._step_overlapped()
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        mask = self._mask_for(batch)
        if mask is not None:
            self._fill(mask)
        t1 = time.perf_counter()
        self.last_batch_size = len(batch.seqs)
        result = self.runner.execute(batch) if batch.seqs else self._no_output
        t2 = time.perf_counter()
        outputs = self.scheduler.update(batch, result)
        t3 = time.perf_counter()
        self.scheduler_seconds += (t1 - t0) + (t3 - t2)
        if batch.seqs:
            self._step_seconds[batch.kind].observe(t3 - t0)
            if self.speed is not None:
                self._observe_speed(batch, t3 - t0)
        self.num_steps += 1
        self._forget_finished(outputs)
        return outputs

    def _observe_speed(self, batch: ScheduledBatch, seconds: float) -> None:
        assert self.speed is not None and self._step_cost is not None
        shape = batch_shape(batch)
        prefill = shape.prefill_tokens > 0
        rows = prefill and self.runner.runs_as_rows(batch)
        self.speed.observe(prefill, self._step_cost.shape_seconds(shape, rows), seconds, rows)

    def _forget_finished(self, outputs: list[TokenOutput]) -> None:
        for o in outputs:
            # NOTE: a finished choice of an n > 1 request: the request lives on in the others.
            if o.finished and o.request_id not in self.scheduler.seqs:
                self.runner.request_gone(o.request_id)

    def _step_overlapped(self) -> list[TokenOutput]:
        """Schedule and launch batch N+1, then read back and apply batch N (the one sync);
        batch N without decodes is read back first (``_read_back_lone``), but on a fifo
        prefill worker, whose steps no arrival can join early anyway."""
        if (self._in_flight is not None and not self._in_flight[0].num_decodes
                and not self.scheduler.fifo_prefill):
            return self._read_back_lone()
        sched, fence = self.scheduler, self.kv.fence
        t0 = time.perf_counter()
        batch = sched.schedule()  # batch N's samples are placeholders in it
        prev = self._in_flight
        prev_start = self._flight_start
        mask = self._mask_for(batch)
        if mask is not None and prev is None:
            self._fill(mask)  # nothing in flight: the matchers are current now
        t1 = time.perf_counter()
        if batch.seqs:
            pending = self.runner.launch(batch)
            self._in_flight = (batch, pending, fence.launched(pending))
            self._flight_start = t1
        else:
            self._in_flight = None
        self.last_batch_size = len(batch.seqs)
        outputs: list[TokenOutput] = []
        t2 = t3 = 0.0
        if prev is not None:
            prev_batch = prev[0]
            self._next_mask = mask
            try:
                # blocks until batch N is done; N+1 computes on
                result, t2 = self._await_batch(prev, prev_start)
                # NOTE: bound here, on grammar steps only: a bound method kept on self is a
                # reference cycle that holds the engine (weights, KV pool) until a full gc.
                outputs = sched.update(prev_batch, result,
                                       self._start_next_fill if mask is not None else None)
            finally:
                if self._next_mask is not None:  # failed before the fill started
                    self._fill(self._next_mask)
                    self._next_mask = None
            t3 = time.perf_counter()
            self._step_seconds[prev_batch.kind].observe(t3 - t0)
            if not batch.seqs:
                self.last_batch_size = len(prev_batch.seqs)
        self.scheduler_seconds += (t1 - t0) + (t3 - t2)
        self.num_steps += 1
        self._forget_finished(outputs)
        return outputs

    def _await_batch(self, flight: tuple[ScheduledBatch, PendingOutput, int], launched_at: float
                     ) -> tuple[RunnerOutput, float]:
        """Wait for a launched batch (``_in_flight``'s triple, launched at ``launched_at``),
        release its fence ticket and time it; its result and when it was read back."""
        batch, pending, ticket = flight
        result = pending.result()
        self.kv.fence.completed(ticket)
        done = time.perf_counter()
        if self.speed is not None:
            # NOTE: the batch computed from its launch or its predecessor's completion,
            # whichever came last: its forward alone, as an overlapped profile times it.
            self._observe_speed(batch, done - max(launched_at, self._last_done))
        self._last_done = done
        return result, done

    def _read_back_lone(self) -> list[TokenOutput]:
        """Read back and apply a batch in flight that holds no decode, before the next one
        is scheduled. Such a batch is prefill alone, a long step (up to
        ``engine.lone_step_target_ms``) that no stream waits on: a prompt or a remote
        prefill's KV that arrived during it then joins the very next step, where batch N+1,
        scheduled ahead, would have made it wait for that one too (two long steps). What
        overlap hides -- the few ms of scheduling -- is small beside such a step."""
        prev = self._in_flight
        assert prev is not None
        t0 = time.perf_counter()
        self._in_flight = None
        result, t1 = self._await_batch(prev, self._flight_start)
        batch = prev[0]
        outputs = self.scheduler.update(batch, result)
        t2 = time.perf_counter()
        self._step_seconds[batch.kind].observe(t2 - t0)
        self.scheduler_seconds += t2 - t1
        self.last_batch_size = len(batch.seqs)
        self.num_steps += 1
        self._forget_finished(outputs)
        return outputs

    def _mask_for(self, batch: ScheduledBatch) -> BatchMask | None:
        """The (unfilled) mask of ``batch``'s grammar rows, attached to it; None when no
        live request has a grammar or none of them samples in this batch."""
        if not self.scheduler.num_grammar_seqs or self._masks is None:
            return None
        rows: list[int] = []
        states = []
        k = 0
        for s, owner in zip(batch.seqs, batch.owners, strict=True):
            if not s.sample:
                continue
            if owner.grammar is not None:
                rows.append(k)
                states.append(owner.grammar)
            k += 1
        if not rows:
            return None
        batch.grammar_mask = self._masks.build(rows, states, k)
        return batch.grammar_mask

    def _fill(self, mask: BatchMask) -> None:
        assert self.grammar is not None
        mask.fill(self.grammar.executor)

    def _start_next_fill(self) -> None:
        """Batch N's tokens have advanced the matchers: fill N+1's mask (which N+1's
        sampler waits for) beside the rest of this step."""
        mask = self._next_mask
        assert mask is not None and self.grammar is not None
        if self._filler is None:
            from services.engine.grammar.batch_mask import MaskFiller

            self._filler = MaskFiller(self.grammar.executor)
        self._filler.start(mask)
        self._next_mask = None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def has_schedulable(self) -> bool:
        """Whether a step may do work now (parked requests need a remote-prefill command;
        a batch in flight needs a step to be read back)."""
        return self.scheduler.has_schedulable() or self._in_flight is not None

    @property
    def in_flight_batch(self) -> ScheduledBatch | None:
        """The batch launched and not yet read back (overlap only)."""
        return self._in_flight[0] if self._in_flight is not None else None

    # ---- disaggregation -------------------------------------------------------------
    def prefix_hit_tokens(self, token_ids: Sequence[int]) -> int:
        """Prompt tokens this engine's prefix cache would serve (block-aligned). Pure."""
        return self.kv.prefix_hit_tokens(token_ids)

    def begin_remote_prefill(self, request: GenerateRequest) -> RemotePrefillHandle | None:
        """Park a validated request for remote prefill; None when its blocks do not fit now."""
        handle = self.scheduler.begin_remote_prefill(request)
        if handle is not None:
            self.runner.request_added(request)
        return handle

    def complete_remote_prefill(
        self, request_id: str, kv: Any, first_token: int, first_logprob: TokenLogprob | None = None
    ) -> TokenOutput | None:
        """Import remote KV and decode; None if not parked. Raises RemoteKvError on bad kv."""
        out = self.scheduler.complete_remote_prefill(request_id, kv, first_token, first_logprob)
        if out is not None:
            self._forget_finished([out])
        return out

    def fail_remote_prefill(self, request_id: str) -> bool:
        """Fall back to local prefill; False if the request is not parked."""
        return self.scheduler.fail_remote_prefill(request_id)

    # ---- moves off a draining worker -------------------------------------------------
    def hold_for_move(self) -> MoveHold:
        """Read back the batch in flight, then hold what can move and abort the rest
        (Scheduler.hold_for_move)."""
        outputs = self.settle()
        held, back = self.scheduler.hold_for_move()
        for rid in back:
            self.runner.request_gone(rid)
        return MoveHold(held, back, outputs)

    def export_held(self, request_id: str, first_block: int, num_blocks: int,
                    num_tokens: int) -> tuple[Any, int]:
        return self.scheduler.export_held(request_id, first_block, num_blocks, num_tokens)

    def settle(self) -> list[TokenOutput]:
        """Read back and apply the batch in flight (overlap), if any: afterwards every
        sequence's tokens are resolved. Its grammar mask was filled by the step that
        launched it."""
        prev = self._in_flight
        if prev is None:
            return []
        self._in_flight = None
        batch, pending, ticket = prev
        result = pending.result()
        self.kv.fence.completed(ticket)
        outputs = self.scheduler.update(batch, result)
        self._forget_finished(outputs)
        return outputs

    def reset_prefix_cache(self) -> tuple[int, int]:
        """Evict every cached block no live sequence references: (evicted, still in use).

        Blocks in use keep their hashes (their sequences go on caching after them), so they
        become hits again once released; between requests that is none."""
        return self.pool.evict_cached(), self.pool.num_used

    # ---- observability --------------------------------------------------------------
    def dump_kv_events(self) -> list[KvEvent]:
        """KvCleared + KvStored events rebuilding the prefix cache (see BlockPool.dump_events)."""
        return self.pool.dump_events()

    def stats(self) -> EngineStats:
        s, p = self.scheduler, self.pool
        left, unbounded = s.decode_tokens_left()
        return EngineStats(
            num_running=len(s.running) + len(s.ready),
            num_waiting=len(s.waiting) + len(s.parked),
            num_parked=len(s.parked),
            kv_blocks_used=p.num_used,
            kv_blocks_cached=p.num_cached,
            kv_blocks_free=p.num_free,
            kv_blocks_total=p.num_blocks,
            prompt_tokens_total=s.prompt_tokens_total,
            prefix_cache_hit_tokens_total=s.prefix_hit_tokens_total,
            num_preemptions_total=s.num_preemptions,
            num_prefill_tokens_pending=s.prefill_tokens_pending(),
            decode_tokens_left=left,
            num_running_unbounded=unbounded,
            grammar=self.grammar.stats if self.grammar is not None else None,
            timings=self.timings,
            runner=self.runner.info,
            step_speed=self.speed.snapshot() if self.speed is not None else None,
            row_step_tokens=self.runner.row_step_tokens,
        )

    def check_integrity(self) -> None:
        """The pool's invariants, and its reference counts equal the live block tables'."""
        self.pool.check_integrity()
        refs: Counter[int] = Counter()
        live = self.scheduler.live_sequences()
        for seq in live:
            refs.update(seq.block_table)
        refs.update(self.kv.fence.held_blocks())  # freed, waiting for the batch in flight
        # Placeholders: only at a sequence's tail, one for the batch in flight at most.
        allowed = 1 if self._in_flight is not None else 0
        for seq in live:
            toks = seq.token_ids
            n = sum(1 for t in toks if t < 0)
            if n > allowed or any(t < 0 for t in toks[: len(toks) - n]):
                raise BlockPoolIntegrityError(
                    f"{seq.request_id}: {n} unresolved placeholder tokens, or not at its tail")
        wrong = [b for b in range(self.pool.num_blocks) if self.pool.ref_count(b) != refs[b]]
        if wrong:
            b = wrong[0]
            raise BlockPoolIntegrityError(
                f"block {b} has ref count {self.pool.ref_count(b)} but {refs[b]} live "
                f"block tables hold it ({len(wrong)} blocks disagree)")
