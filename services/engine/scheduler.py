"""Continuous batching by computed vs target tokens, with a prefill token budget.

There are no prefill and decode phases (vLLM v1): every step each running sequence
computes some of ``token_ids[num_computed_tokens:]``, and samples once all are computed.

One step (``schedule``), a function of scheduler state alone (it calls no runner; it
may wait for the batch in flight to free blocks before it preempts, ``fence.drain``), so
the engine can schedule step N+1 while step N computes:

1. Remote-prefilled sequences (READY) take free seats (``max_num_seqs``).
2. Every running sequence with one token left (a decode) gets it. Decodes are never
   starved by prefills: the prefill budget is ``max_num_batched_tokens - num_decodes``.
   Under an ITL target (``chunk_limit``, ``engine.itl_target_ms``) the step's prefill
   slices also share the seconds the step-time model leaves beside the decodes
   (services/steptime/chunk.py), whether or not others wait; the first slice of a step
   takes at least one block whatever the target, so a prompt never starves. Where the model
   says the decodes cost less in a step of their own (``ChunkLimit.split_pays``: a CPU's
   one-call decode kernel, past a few streams), a step prefills alone and the next one is
   the decodes' alone, the two together within the target. With no decode running, the
   step's prefill is still cut to ``engine.lone_step_target_ms`` (but on a fifo prefill
   worker, and only while requests overlap: one of the last ``LONE_BOUND_REQUESTS``
   arrived while another was live): a prompt, a remote prefill's KV or any command that
   arrives mid-step waits for the step thread at most that long, not for a whole long
   prompt's step. One request at a time has nothing to let in, and each cut costs a
   prompt's prefill time (an 850-token prompt on 2 threads: 943 tok/s whole, 629-831 in
   the three slices the bound cut it into; docs/benchmarks.md "What waits for a step").
   In such a step the head of the queue, if all of it fits the step's tokens and seconds, goes before the
   running prompts' next slices (share order), which share what it leaves.
3. Running sequences in the middle of a chunked prefill continue, chunked to the budget --
   and, while requests wait, to ``long_prefill_token_threshold``, so that one long prompt
   never holds the whole budget: a short request behind it starts within a step.
4. Waiting requests are admitted in strict FIFO: the head is admitted whole if it fits
   the remaining budget, else it waits (nothing behind it jumps ahead) -- unless it is the
   first admission of the step or a long prompt (more than the threshold, or than the
   whole budget), then it is chunked (to the threshold when others wait behind it).
   Nothing is admitted in a step that preempted.
5. ``fifo_prefill`` (``engine.prefill_order``; a prefill worker's default): prompts finish in
   arrival order. No slice is capped for the ones waiting behind it, and a waiting prompt
   joins a step that holds another prompt's slice only if all of it fits: two long prompts
   pulled together then finish one prefill apart, not both at the end of the second.

Remote prefill (decode side of disaggregation, see remote_prefill.py) parks a sequence
(PARKED: holds blocks, never scheduled) until its KV is imported (READY) or the remote
prefill failed (back to WAITING, first in line). Completing or failing a request that is
no longer parked (a duplicate, or after an abort) does nothing.

When blocks run out, the newest running sequence is preempted by recompute: its blocks
are freed and it goes back to the head of the waiting queue, to resume from prompt +
generated tokens (reusing whatever the prefix cache still holds).

``schedule`` advances each scheduled sequence as if its batch had run already
(``num_computed_tokens``, and a placeholder for the token it samples), so the next batch
can be scheduled before this one's result is read: that is what lets the engine overlap
them (docs/engine.md "The overlapped loop"). ``update`` then writes the real tokens in
place of the placeholders, applies stop conditions and registers the computed blocks.
A sequence that finished (or was aborted) meanwhile ignores the rest of its batches.
"""

from __future__ import annotations

import math
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any

import numpy as np

from services.api.outputs import FinishReason, TokenLogprob, TokenOutput
from services.api.sampling import SamplingParams
from services.common.errors import InvalidRequest
from services.engine.batch import (
    FUTURE_REGIONS,
    PenaltyInit,
    RunnerOutput,
    ScheduledBatch,
    ScheduledSeq,
    placeholder,
)
from services.engine.kv_cache_manager import NO_HIT, KvCacheManager, PrefixHit
from services.engine.move import HeldRequest, MoveRefused
from services.engine.remote_prefill import (
    KvImporter,
    RemoteKvError,
    RemotePrefillHandle,
    remote_kv_problem,
)
from services.engine.request import GenerateRequest
from services.engine.sequence import SeqStatus, Sequence
from services.engine.timings import EngineTimings
from services.steptime.chunk import ChunkLimit

if TYPE_CHECKING:
    from services.engine.grammar.compiler import GrammarCompiler

# The lone step bound (module docstring, 2.) holds until this many requests in a row arrived
# with no other live: a count, not a time, so that the simulator's runs stay deterministic.
LONE_BOUND_REQUESTS = 8


class InvalidRequestError(InvalidRequest, ValueError):
    """A request the engine can never serve; the message names the request and the reason."""


class Scheduler:
    """Owns every live Sequence and decides each step's work; see the module docstring.

    ``chunk_limit``: the ITL target's limit on each step's prefill (None: the token budget
    alone); its ``StepCost`` is read once here, each step only does arithmetic.

    ``kv_exporter(block_ids)`` (the runner's ``export_kv``) is called in ``update`` for a
    finishing request that asked for its KV, before its blocks are freed. ``kv_importer``
    (the runner) receives remote KV in ``complete_remote_prefill``; without one, remote
    prefill is refused.

    Requests are checked once, at the entry (``validate``); ``add`` and
    ``begin_remote_prefill`` trust that and only refuse an id that is already live.
    """

    def __init__(
        self,
        kv: KvCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        long_prefill_token_threshold: int | None = None,
        fifo_prefill: bool = False,
        chunk_limit: ChunkLimit | None = None,
        vocab_size: int,
        eos_token_ids: Iterable[int],
        kv_exporter: Callable[[Seq[int]], Any] | None = None,
        kv_importer: KvImporter | None = None,
        grammar: GrammarCompiler | None = None,
        timings: EngineTimings | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.kv = kv
        self.block_size = kv.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # fifo: no prompt's slice is capped for the ones behind it (module docstring, 5.)
        self.long_prefill = (max_num_batched_tokens if fifo_prefill else
                             min(long_prefill_token_threshold or max_num_batched_tokens,
                                 max_num_batched_tokens))
        self.fifo_prefill = fifo_prefill
        self.chunk_limit = chunk_limit
        # The last step prefilled alone beside running streams (ChunkLimit.split_pays): this
        # one is theirs, decodes alone.
        self._decode_turn = False
        # The step being scheduled holds a few prefill tokens as rows beside the decodes
        # (ChunkLimit.takes_rows): its slices are priced at the row steps' cost.
        self._rows_step = False
        self.model_max_len = max_model_len
        # NOTE: a sequence can never hold more tokens than the whole pool, or it would
        # preempt itself forever; past that it finishes with LENGTH.
        self.max_model_len = min(max_model_len, kv.num_blocks * kv.block_size)
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.kv_exporter = kv_exporter
        self.kv_importer = kv_importer
        self.grammar = grammar
        # Each request's queue, prefill and decode time; the clock is read only at those
        # edges (arrival, first scheduling, first and last token), never for a decision.
        self.timings = timings if timings is not None else EngineTimings()
        self.clock = clock
        self.num_grammar_seqs = 0  # live sequences with a grammar: 0 = no batch needs a mask
        # Requests added since the last one that arrived while another was live (module
        # docstring, 2.): the lone step bound applies while this is under LONE_BOUND_REQUESTS.
        self.solo_arrivals = LONE_BOUND_REQUESTS
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.ready: deque[Sequence] = deque()
        self.parked: dict[str, Sequence] = {}
        self.held: dict[str, Sequence] = {}  # moving off this (draining) worker: move_out.py
        self.seqs: dict[str, Sequence] = {}
        self.num_preemptions = 0
        self.prompt_tokens_total = 0
        self.prefix_hit_tokens_total = 0
        # Future-token slots (batch.placeholder): FUTURE_REGIONS regions of max_num_seqs,
        # one region per batch in turn.
        self.num_future_slots = FUTURE_REGIONS * max_num_seqs
        self._future_base = 0
        self._future_next = 0
        # Penalty slots (logits_process.py): free ones to reuse, and the next never used.
        self._free_penalty_slots: list[int] = []
        self._next_penalty_slot = 0

    # ---- requests -------------------------------------------------------------------
    def validate(self, request: GenerateRequest) -> None:
        """Raise InvalidRequestError for a request that can never be served. Pure: reads
        config only, so it may run on any thread (AsyncEngine.validate)."""
        rid = request.request_id
        prompt = request.prompt_token_ids
        n = len(prompt)
        if n == 0:
            raise InvalidRequestError(f"request {rid!r}: prompt is empty")
        if n >= self.model_max_len:
            raise InvalidRequestError(
                f"request {rid!r}: prompt of {n} tokens leaves no room to generate "
                f"within max_model_len {self.model_max_len}")
        if n >= self.max_model_len:
            raise InvalidRequestError(
                f"request {rid!r}: prompt of {n} tokens can never fit in the KV cache "
                f"({self.kv.num_blocks} blocks of {self.block_size} tokens)")
        hashes = request.block_hashes
        if hashes is not None and len(hashes) != n // self.block_size:
            raise InvalidRequestError(
                f"request {rid!r}: {len(hashes)} block_hashes for a prompt of {n // self.block_size} "
                f"full blocks of {self.block_size} tokens")
        bad = _token_outside(prompt, self.vocab_size)
        if bad is not None:
            raise InvalidRequestError(
                f"request {rid!r}: token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        if request.images:
            from services.model.image_spans import check_spans

            try:
                check_spans(request.images, n)
            except ValueError as e:
                raise InvalidRequestError(f"request {rid!r}: {e}") from None
        frm = request.export_kv_from_block
        if frm is not None and not 0 <= frm < -(-n // self.block_size):
            raise InvalidRequestError(
                f"request {rid!r}: export_kv_from_block {frm} is outside the prompt's "
                f"{-(-n // self.block_size)} blocks")
        bias = request.sampling.logit_bias
        if bias and bias[-1][0] >= self.vocab_size:
            raise InvalidRequestError(
                f"request {rid!r}: logit_bias token id {bias[-1][0]} is outside the "
                f"vocabulary [0, {self.vocab_size})")

    def _check_not_live(self, rid: str) -> None:
        # NOTE: a second sequence under a live id would orphan the first one's blocks.
        if rid in self.seqs:
            raise InvalidRequestError(f"request {rid!r}: a request with this id is already live")

    def add(self, request: GenerateRequest) -> Sequence:
        """Queue a validated request (see ``validate``)."""
        self._check_not_live(request.request_id)
        self._arrived()
        seq = self._new_seq(request)
        # NOTE: the hashes match_prefix computes stay on the sequence for its admission, so
        # this costs only the pool lookups, which a second lookup repeats at admission.
        if not seq.wants_prompt_logprobs:
            seq.num_expected_hit_tokens = self.kv.match_prefix(seq).num_tokens
        if request.sampling.n > 1:
            seq.group = [seq]
        self.seqs[request.request_id] = seq
        self.num_grammar_seqs += seq.grammar is not None
        self.waiting.append(seq)
        return seq

    def _arrived(self) -> None:
        """Count a new request for the lone step bound (``solo_arrivals``)."""
        self.solo_arrivals = 0 if self.seqs else self.solo_arrivals + 1

    def _new_seq(self, request: GenerateRequest) -> Sequence:
        """The request's Sequence, with its grammar's matcher when it has one: replayed over
        the tokens it produced before a migration (the prompt's last ``seed_step_offset``)."""
        seq = Sequence.from_request(request)
        seq.queued_at = self.clock()
        spec = request.sampling.structured
        if spec is not None:
            if self.grammar is None:
                raise InvalidRequestError(f"request {request.request_id!r}: structured output "
                                          "is not available on this worker")
            n = request.sampling.seed_step_offset
            replay = request.prompt_token_ids[len(request.prompt_token_ids) - n:] if n else []
            try:
                seq.grammar = self.grammar.start(spec, replay)
            except ValueError as e:
                raise InvalidRequestError(f"request {request.request_id!r}: {e}") from None
        return seq

    def abort(self, request_id: str) -> TokenOutput | None:
        """Free everything of a live request at once, every choice of it; None if it is
        not live. The one ABORT output ends the request's stream."""
        seq = self.seqs.get(request_id)
        if seq is None:
            return None
        out = self._output(seq, [], FinishReason.ABORT)
        for s in list(seq.group) if seq.group is not None else [seq]:
            st = s.status
            if st is SeqStatus.WAITING:
                self.waiting.remove(s)
            elif st is SeqStatus.RUNNING:
                self.running.remove(s)
            elif st is SeqStatus.READY:
                self.ready.remove(s)
            elif st is SeqStatus.PARKED:
                del self.parked[request_id]
            elif st is SeqStatus.HELD:
                del self.held[request_id]
            self._finish(s, FinishReason.ABORT)
        return out

    def live_sequences(self) -> list[Sequence]:
        """Every live sequence, each choice of an n > 1 request included."""
        out: list[Sequence] = []
        for s in self.seqs.values():
            out.extend(s.group if s.group is not None else (s,))
        return out

    def decode_tokens_left(self) -> tuple[int, int]:
        """(output tokens the running sequences with a max_tokens may still produce, how many
        running sequences have none): the planner's estimate of the decode work in flight.
        O(running); may be read from another thread (``EngineStats``)."""
        left = unbounded = 0
        for s in (*self.running, *self.ready):
            cap = s.sampling.max_tokens
            if cap is None:
                unbounded += 1
            else:
                left += max(0, cap - s.num_generated)
        return left, unbounded

    def prefill_tokens_pending(self) -> int:
        """Tokens still to compute before first samples: for waiting sequences, their tokens
        less what they hold or expect from the prefix cache (``num_expected_hit_tokens``); for
        running ones still prefilling (more than the one decode token left), their uncomputed
        tokens (which already leave out their hit). Parked remote prefills are not counted.
        O(waiting + running); may be read from another thread (``EngineStats``)."""
        total = 0
        # NOTE: tuple()/list() copy the containers in C, without a thread switch: iterating
        # them directly could race the step thread ("deque mutated during iteration").
        for s in tuple(self.waiting):
            total += s.num_tokens - max(s.num_computed_tokens, s.num_expected_hit_tokens)
        for s in list(self.running):
            left = s.num_tokens - s.num_computed_tokens
            if left > 1 or s.num_computed_tokens < s.num_prompt_tokens:
                total += left
        return total

    def has_unfinished(self) -> bool:
        return bool(self.seqs)

    def has_schedulable(self) -> bool:
        """Whether ``schedule`` may produce work (parked sequences wait for a command)."""
        return bool(self.waiting or self.running or self.ready)

    # ---- remote prefill (decode side) -----------------------------------------------
    def begin_remote_prefill(self, request: GenerateRequest) -> RemotePrefillHandle | None:
        """Park a validated request with blocks for its whole prompt (its prefix hits, then
        fresh blocks including a trailing partial one); None if they do not fit now."""
        if self.kv_importer is None:
            raise RuntimeError("remote prefill needs a scheduler with a kv_importer")
        rid = request.request_id
        self._check_not_live(rid)
        self._arrived()
        seq = self._new_seq(request)
        hit = self.kv.match_prefix(seq)
        n = seq.num_tokens - hit.num_tokens
        # NOTE: blocks freed while a batch is in flight are held until it completes; wait
        # for it rather than send the request to local prefill for a lack of them.
        if self.kv.allocate(seq, n, hit) is None and (
                not self.kv.fence.drain() or self.kv.allocate(seq, n, hit) is None):
            return None
        self._count_admission(seq, hit)
        n_hit = len(hit.block_ids)
        if request.sampling.n > 1:
            seq.group = [seq]
        seq.status = SeqStatus.PARKED
        seq.remote_fill_from = n_hit
        self.seqs[rid] = seq
        self.num_grammar_seqs += seq.grammar is not None
        self.parked[rid] = seq
        return RemotePrefillHandle(rid, hit.num_tokens, n_hit, len(seq.block_table) - n_hit)

    def complete_remote_prefill(self, request_id: str, kv: Any, first_token: int,
                                first_logprob: TokenLogprob | None = None) -> TokenOutput | None:
        """Import a parked request's KV, mark its prompt computed, register its full blocks
        in the prefix cache, append ``first_token`` (stop conditions apply) and queue it for
        decode; None if it is not parked. Bad ``kv``: RemoteKvError, after falling back to
        local prefill."""
        seq = self.parked.get(request_id)
        if seq is None:
            return None
        importer = self.kv_importer
        assert importer is not None  # begin_remote_prefill refused to park without one
        blocks = seq.block_table[seq.remote_fill_from :]
        problem = remote_kv_problem(importer.kv_spec, self.vocab_size, len(blocks), kv,
                                    first_token)
        if problem is None:
            try:
                importer.import_kv(blocks, kv)
            except ValueError as e:
                problem = str(e)
        if problem is not None:
            self.fail_remote_prefill(request_id)
            raise RemoteKvError(f"remote prefill of {request_id!r}: {problem}; "
                                "falling back to local prefill")
        del self.parked[request_id]
        seq.remote_fill_from = -1
        seq.num_computed_tokens = seq.num_prompt_tokens
        self.kv.cache_computed_blocks(seq)
        if seq.group is not None:
            self._fork(seq)
        out = self._append_token(seq, first_token, first_logprob)
        if not out.finished:
            seq.status = SeqStatus.READY
            self.ready.append(seq)
        return out

    def fail_remote_prefill(self, request_id: str) -> bool:
        """Send a parked request to local prefill (first in line), keeping its prefix hits;
        False if it is not parked."""
        seq = self.parked.pop(request_id, None)
        if seq is None:
            return False
        self.kv.truncate(seq, seq.remote_fill_from)
        seq.remote_fill_from = -1
        seq.status = SeqStatus.WAITING
        # NOTE: it already waited for the remote prefill; it goes first, like a preemption.
        self.waiting.appendleft(seq)
        return True

    # ---- moves off a draining worker (services/decode/move_out.py) --------------------
    def hold_for_move(self) -> tuple[list[HeldRequest], list[str]]:
        """Take every live request off the schedule; call with no batch in flight
        (``LLMEngine.settle``). A running one-choice request that produced a token and has
        only that last token uncomputed is HELD: blocks kept, never scheduled again, until
        ``export_held`` copies them or ``abort`` frees them. Every other one (waiting,
        parked, ready, mid-prefill, n > 1, with images: a target would hash its blocks
        without them) is aborted, its id returned second: it goes back to the processor (no
        token of it is lost; a partial prefill is recomputed)."""
        held: list[HeldRequest] = []
        back: list[str] = []
        for rid, seq in list(self.seqs.items()):
            n = seq.num_tokens - 1
            if (seq.status is SeqStatus.RUNNING and seq.group is None and seq.num_generated > 0
                    and seq.num_computed_tokens == n and seq.token_ids[-1] >= 0
                    and not seq.length_capped and not seq.request.images):
                self.running.remove(seq)
                seq.status = SeqStatus.HELD
                self.held[rid] = seq
                held.append(HeldRequest(rid, n, -(-n // self.block_size)))
            else:
                self.abort(rid)
                back.append(rid)
        return held, back

    def export_held(self, request_id: str, first_block: int, num_blocks: int,
                    num_tokens: int) -> tuple[Any, int]:
        """(a copy of the held request's blocks ``[first_block, first_block + num_blocks)``,
        its last token). KeyError: not held; MoveRefused: the tokens or blocks asked for are
        not the held ones (the target's prefix cache may spare the leading blocks)."""
        seq = self.held[request_id]
        n = seq.num_tokens - 1
        end = -(-n // self.block_size)
        if num_tokens != n or first_block < 0 or first_block + num_blocks != end:
            raise MoveRefused(f"request {request_id!r} holds the KV of {n} tokens in {end} blocks; "
                              f"asked for {num_tokens} tokens, blocks [{first_block}, "
                              f"+{num_blocks})")
        assert self.kv_exporter is not None
        return self.kv_exporter(seq.block_table[first_block:end]), seq.token_ids[-1]

    # ---- one step -------------------------------------------------------------------
    def schedule(self, split: bool = True, head_first: bool = True) -> ScheduledBatch:
        """The next batch (module docstring). ``split``: whether the step may prefill alone
        beside running streams (tried again without when such a step found nothing it
        could prefill). ``head_first``: whether a step with no stream may set time aside for
        the queue's head (tried again without when the head could not use it and the step
        came out empty)."""
        out: list[ScheduledSeq] = []
        owners: list[Sequence] = []
        self._future_next = self._future_base
        running = self.running
        while self.ready and len(running) < self.max_num_seqs:
            s = self.ready.popleft()
            s.status = SeqStatus.RUNNING
            running.append(s)
        num_decodes = decode_context = prefilling = 0
        for s in running:
            if s.num_tokens - s.num_computed_tokens == 1 and not s.length_capped:
                num_decodes += 1
                decode_context += s.num_tokens
            elif not s.length_capped:
                prefilling += 1
        budget = self.max_num_batched_tokens - num_decodes
        # NOTE: the cap matters only when someone waits for the budget it leaves.
        chunk_cap = self.long_prefill if self.waiting else budget
        # Seconds the step's prefill slices may still add under the ITL target, or the lone
        # step target with no decode running; inf: neither.
        limit = self.chunk_limit
        left = math.inf
        self._rows_step = False
        decode_turn, self._decode_turn = self._decode_turn, False
        alone = False  # a step of prefill alone: the decodes wait for the next (split_pays)
        if limit is not None and num_decodes:
            queued = prefilling + len(self.waiting)
            if decode_turn:
                left = 0.0  # the streams' own step: no prefill at all
            elif split and queued and limit.split_pays(num_decodes, decode_context):
                alone = True
                left = limit.split_seconds_left(num_decodes, decode_context, queued)
            else:
                left = limit.seconds_left(num_decodes, decode_context, queued)
            if not decode_turn and queued and limit.takes_rows(left, self._head_start()):
                # a few prefill tokens as rows beside the decodes (the runner's cheap path)
                alone = False
                budget = min(budget, limit.row_tokens)
                left = limit.seconds_left(num_decodes, decode_context, queued, rows=True)
                self._rows_step = True
        elif limit is not None and not self.fifo_prefill and self.solo_arrivals < LONE_BOUND_REQUESTS:
            left = limit.lone_seconds_left()  # what arrives mid-step waits for it (module docstring)
        # With no stream running, the queue's head goes before a running prompt's next slice
        # if all of it fits the step (tokens and seconds): that slice would take the step's
        # seconds, and a short prompt would wait out the long one's whole prefill.
        # Only where the head surely gets in (a seat; blocks for it and for the running
        # slices): a reservation it cannot use would leave the step empty.
        reserved, reserved_s = 0, 0.0
        if (head_first and not num_decodes and prefilling and left < math.inf and self.waiting
                and len(running) < self.max_num_seqs):
            head = self.waiting[0]
            need = head.num_tokens - head.num_computed_tokens
            bs = self.block_size
            blocks = -(-need // bs) + -(-(budget - need) // bs) + 2 * prefilling
            if need <= min(budget, self.long_prefill) and blocks <= self.kv.pool.num_available:
                cost = self._slice_seconds(need, head.num_computed_tokens)
                if cost <= left:
                    reserved, reserved_s = need, cost
                    budget -= need
                    left -= cost
        prefilled = reserved > 0  # whether a prefill slice is in the step (the floor is given)
        preempted = 0
        decodes = 0  # sequences scheduled for one decode token: the step's kind
        i = 0
        while i < len(running):
            seq = running[i]
            if seq.length_capped:
                i += 1  # finishes when the batch in flight is read; never a victim either
                continue
            remaining = seq.num_tokens - seq.num_computed_tokens
            if remaining == 1:
                if alone:
                    i += 1
                    continue
                n = 1
            elif decode_turn:
                i += 1
                continue
            else:
                n = min(remaining, budget, chunk_cap)
                if left < math.inf:
                    n = self._under_target(n, seq.num_computed_tokens, left, prefilled)
                if n <= 0:
                    i += 1
                    continue
            while self.kv.allocate(seq, n) is None:
                # NOTE: blocks held for the batch in flight come back once it completes:
                # a short wait beats preempting a sequence for them.
                if self.kv.fence.drain():
                    continue
                j = len(running) - 1
                while running[j].length_capped:  # stops at i: seq is not capped
                    j -= 1
                victim = running.pop(j)  # the newest, never one scheduled already
                preempted += 1
                if victim is not seq and victim.num_tokens - victim.num_computed_tokens == 1:
                    budget += 1  # its decode token is no longer reserved
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                out.append(self._schedule_seq(seq, n))
                owners.append(seq)
                if remaining > 1:
                    budget -= n
                    if left < math.inf:
                        left -= self._slice_seconds(n, seq.num_computed_tokens - n)
                    prefilled = True
                else:
                    decodes += 1
                i += 1
        if not preempted:
            if not decode_turn:
                self._admit(out, owners, budget + reserved, left + reserved_s, prefilled)
        else:
            self._expect_hits(preempted)
        if reserved and not out and not preempted:  # nothing changed: the running slices' turn
            return self.schedule(split, head_first=False)
        if alone:
            if not out:  # nothing could prefill (no seat, no block): the decodes, as usual
                return self.schedule(split=False)
            self._decode_turn = True
        batch = ScheduledBatch(out, owners, self._future_base, num_decodes=decodes)
        if self._future_next != self._future_base:
            self._future_base = (self._future_base + self.max_num_seqs) % self.num_future_slots
        return batch

    def _head_start(self) -> int:
        """Computed tokens of the first prompt this step would prefill: the first running
        one still prefilling, else the head of the queue (its prefix hit not looked up)."""
        for s in self.running:
            if s.num_tokens - s.num_computed_tokens > 1 and not s.length_capped:
                return s.num_computed_tokens
        return self.waiting[0].num_computed_tokens if self.waiting else 0

    def _under_target(self, n: int, start: int, left: float, prefilled: bool) -> int:
        """``n`` cut to what a slice after ``start`` computed tokens fits in ``left`` seconds;
        the step's first prefill slice keeps at least the floor (one block) of ``n``."""
        limit = self.chunk_limit
        assert limit is not None
        fits = limit.cost_of(self._rows_step).slice_tokens(left, start)
        if fits >= n:
            return n
        return fits if prefilled else max(fits, min(n, limit.floor_tokens))

    def _slice_seconds(self, n: int, start: int) -> float:
        limit = self.chunk_limit
        assert limit is not None
        return limit.cost_of(self._rows_step).slice_seconds(n, start)

    def _admit(self, out: list[ScheduledSeq], owners: list[Sequence], budget: int,
               left: float, prefilled: bool) -> None:
        """Admit waiting requests (module docstring, 4.) within ``budget`` tokens and
        ``left`` seconds of the ITL target (inf: none; ``prefilled``: the step holds a
        prefill slice already, so the floor is given)."""
        waiting = self.waiting
        first = True
        while waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = waiting[0]
            # NOTE: prompt logprobs need the logits of every prompt position: such a
            # request takes nothing from the prefix cache (its blocks still go there).
            hit = (self.kv.match_prefix(seq) if not seq.block_table and not seq.wants_prompt_logprobs
                   else NO_HIT)
            computed = hit.num_tokens if hit.block_ids else seq.num_computed_tokens
            remaining = seq.num_tokens - computed
            cap = min(budget, self.long_prefill) if len(waiting) > 1 else budget
            if left < math.inf:
                cap = self._under_target(cap, computed, left, prefilled)
                if cap <= 0:
                    break
            if remaining <= cap:
                n = remaining
            elif self.fifo_prefill:
                if prefilled:
                    break  # a slice beside another prompt's would delay that one's end
                n = cap
            elif first or remaining > self.long_prefill:
                n = cap  # chunk rather than starve the head, or the ones behind a long head
            else:
                break  # strict FIFO: wait for a step with room
            if self.kv.allocate(seq, n, hit) is None:
                break
            waiting.popleft()
            self._count_admission(seq, hit)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.append(self._schedule_seq(seq, n))
            owners.append(seq)
            budget -= n
            if left < math.inf:
                left -= self._slice_seconds(n, computed)
            prefilled = True
            first = False

    def _count_admission(self, seq: Sequence, hit: PrefixHit) -> None:
        """Count a request's prompt and prefix hit once, on its first admission."""
        if not seq.admitted:
            seq.admitted = True
            seq.scheduled_at = now = self.clock()
            self.timings.queue_seconds.observe(now - seq.queued_at)
            seq.num_cached_tokens = hit.num_tokens
            self.prompt_tokens_total += seq.num_prompt_tokens
            self.prefix_hit_tokens_total += hit.num_tokens

    def _schedule_seq(self, seq: Sequence, n: int) -> ScheduledSeq:
        """The sequence's work for this batch; advances it as if the batch had run."""
        start = seq.num_computed_tokens
        end = start + n
        toks = seq.token_ids
        sample = end == len(toks)
        out = ScheduledSeq(seq.request_id, toks[start:end], start, seq.block_table,
                           sample, seq.sampling, len(toks) - seq.num_prompt_tokens,
                           images=seq.request.images if start < seq.num_prompt_tokens else ())
        if start < seq.num_prompt_tokens - 1 and seq.wants_prompt_logprobs:
            out.prompt_targets = tuple(toks[start + 1 : min(end, seq.num_prompt_tokens - 1) + 1])
        seq.num_computed_tokens = end
        sp = seq.sampling
        if sample and sp.processes_logits:
            if sp.penalized:
                if seq.penalty_slot < 0:
                    seq.penalty_slot = self._take_penalty_slot()
                    # NOTE: a migrated request's last seed_step_offset prompt tokens are
                    # ones it generated: they count for the penalties.
                    cut = max(seq.num_prompt_tokens - sp.seed_step_offset, 0)
                    out.penalty_init = PenaltyInit(tuple(toks[:cut]), tuple(toks[cut:]))
                out.penalty_slot = seq.penalty_slot
            if out.num_generated + sp.seed_step_offset < sp.min_tokens:
                out.banned_ids = self._min_tokens_ban(sp)
        if sample and seq.group is not None and not seq.forked:
            self._fork(seq)
        if sample:
            toks.append(placeholder(self._future_next))
            self._future_next += 1
            max_tokens = seq.sampling.max_tokens
            if end + 1 >= self.max_model_len or (
                    max_tokens is not None and end + 1 - seq.num_prompt_tokens >= max_tokens):
                seq.length_capped = True
        return out

    def _fork(self, parent: Sequence) -> None:
        """Start choices 1 .. n-1 of ``parent``'s request, whose prompt KV is computed (or
        is being computed by the batch just scheduled: the choices join a later one).

        They share the prompt's full blocks (references taken), except the last block the
        prompt touches: each choice recomputes that tail (at most ``block_size`` tokens,
        the last prompt token's logits included) into a block of its own. That is
        copy-on-write with the copy done by the forward; it also gives each choice the
        logits of its own first draw. They enter as READY (seats permitting, next step)."""
        parent.forked = True
        group = parent.group
        assert group is not None
        n_prompt = parent.num_prompt_tokens
        n_shared = (n_prompt - 1) // self.block_size
        prompt = parent.token_ids[:n_prompt]
        for i in range(1, parent.sampling.n):
            # NOTE: the images too: the recomputed tail may hold image tokens.
            req = GenerateRequest(parent.request_id, prompt, parent.sampling.for_choice(i),
                                  images=parent.request.images)
            child = self._new_seq(req)  # with a grammar: its own matcher
            self.num_grammar_seqs += child.grammar is not None
            child.choice, child.group, child.forked = i, group, True
            self.kv.share_prefix(parent, child, n_shared)
            child.admitted = True  # the prompt is counted once, by choice 0
            child.num_cached_tokens = parent.num_cached_tokens
            child.status = SeqStatus.READY
            group.append(child)
            self.ready.append(child)

    def _take_penalty_slot(self) -> int:
        if self._free_penalty_slots:
            return self._free_penalty_slots.pop()
        self._next_penalty_slot += 1
        return self._next_penalty_slot - 1

    def _min_tokens_ban(self, sp: SamplingParams) -> tuple[int, ...]:
        """What cannot be sampled before min_tokens: every token that would stop it."""
        eos = () if sp.ignore_eos else self.eos_token_ids
        return tuple(sorted({*eos, *sp.stop_token_ids}))

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _expect_hits(self, n: int) -> None:
        """Estimate the prefix hits of the ``n`` sequences just preempted (the head of the
        waiting queue): their full blocks went to the cache, less what this step's
        allocations evicted again, hence after the allocations, not in ``_preempt``."""
        for i in range(n):
            seq = self.waiting[i]
            seq.num_expected_hit_tokens = self.kv.match_prefix(seq).num_tokens

    # ---- runs of plain decode steps (the simulator's fast path) -----------------------
    def decode_run_length(self, limit: int, token: int) -> int:
        """How many of the next steps, at most ``limit``, are certain to be the same batch
        of decodes and nothing else if every one of them samples ``token``: nothing waits or
        is ready to join, no grammar, every running sequence decodes, none of them finishes
        in those steps, and the pool holds the blocks they fill. 0 when the next step is not
        such a step (one with its prompt's last token left is not decoding).
        ``advance_decodes`` then does those steps at once."""
        running = self.running
        if limit <= 0 or self.waiting or self.ready or self.num_grammar_seqs or not running:
            return 0
        is_eos = token in self.eos_token_ids
        k = limit
        max_len = self.max_model_len
        for s in running:
            # NOTE: one token left that is the prompt's last (a prefill chunked down to one
            # token) samples the first token: an output a run would not make.
            if (s.length_capped or s.num_tokens - s.num_computed_tokens != 1
                    or s.num_tokens <= s.num_prompt_tokens):
                return 0
            sp = s.sampling
            if (is_eos and not sp.ignore_eos) or token in sp.stop_token_ids:
                return 0
            # NOTE: step j leaves it num_tokens + j tokens; the step that reaches a length
            # limit finishes it, so stop one before (the normal step then finishes it).
            left = max_len - s.num_tokens
            if sp.max_tokens is not None:
                left = min(left, sp.max_tokens - s.num_generated)
            if left - 1 < k:
                k = left - 1
                if k <= 0:
                    return 0
        available = self.kv.pool.num_available
        while k > 0 and self._blocks_for_decodes(k) > available:
            k //= 2
        return k

    def _blocks_for_decodes(self, k: int) -> int:
        grow = self.kv.blocks_to_grow
        return sum(max(0, grow(s, k)) for s in self.running)

    def advance_decodes(self, k: int, token: int) -> None:
        """Apply ``k`` decode steps of the running batch, each sampling ``token``: the state
        ``k`` rounds of ``schedule`` and ``update`` would leave (tokens, computed counts,
        blocks, prefix-cache entries and their KV events; blocks are taken per sequence
        rather than per step, the same number from the same free and eviction order).
        Only for ``k <= decode_run_length(k, token)``; no outputs are made."""
        if k > 0:
            self._decode_turn = False  # the first of them was the streams' own step
        for s in self.running:
            if self.kv.allocate(s, k) is None:
                raise RuntimeError(f"advance_decodes({k}): no blocks for {s.request_id!r}; "
                                   "k must come from decode_run_length")
            s.num_computed_tokens += k
            s.token_ids.extend([token] * k)
            self.kv.cache_computed_blocks(s)

    # ---- after the forward ----------------------------------------------------------
    def update(self, batch: ScheduledBatch, result: RunnerOutput,
               grammars_advanced: Callable[[], None] | None = None) -> list[TokenOutput]:
        """Apply a completed batch's result: register the blocks it computed, put its
        samples in place of their placeholders, stop, free. ``grammars_advanced`` is called
        once every grammar row's matcher has taken its token, before the rest of the work
        (the overlapped loop starts the next batch's mask fill there)."""
        if grammars_advanced is not None:
            if self.num_grammar_seqs:
                self._advance_grammars(batch, result.sampled)
            grammars_advanced()
        outputs: list[TokenOutput] = []
        any_finished = False
        logprobs = result.logprobs or [None] * len(batch.seqs)
        prompt_lps = result.prompt_logprobs
        for i, (sched, seq, tok, lp) in enumerate(zip(batch.seqs, batch.owners, result.sampled,
                                                      logprobs, strict=True)):
            st = seq.status
            if st is SeqStatus.FINISHED:
                continue  # aborted, or finished by the batch before: its token is dropped
            if st is SeqStatus.RUNNING:  # else preempted since: its blocks are gone
                self.kv.cache_computed_blocks(seq, sched.end_pos)
            if sched.prompt_targets:
                self._keep_prompt_logprobs(seq, sched, prompt_lps[i] if prompt_lps else None)
            if not sched.sample:
                continue
            if tok is None:
                raise RuntimeError(f"runner sampled no token for {sched.request_id!r}")
            out = self._resolve_token(seq, sched.end_pos, tok, lp)
            outputs.append(out)
            if out.finished and st is SeqStatus.RUNNING:
                any_finished = True
        if any_finished:
            self.running = [s for s in self.running if s.status is SeqStatus.RUNNING]
        return outputs

    def _advance_grammars(self, batch: ScheduledBatch, sampled: list[int | None]) -> None:
        """Advance each live grammar row's matcher by its token, as ``_resolve_token``
        would (which then finds the position consumed)."""
        for sched, seq, tok in zip(batch.seqs, batch.owners, sampled, strict=True):
            g = seq.grammar
            if (g is not None and sched.sample and tok is not None
                    and seq.status is not SeqStatus.FINISHED and seq.sampling.max_tokens != 0):
                g.advance_at(sched.end_pos, tok)

    def _keep_prompt_logprobs(self, seq: Sequence, sched: ScheduledSeq,
                              lps: list[TokenLogprob] | None) -> None:
        if lps is None or len(lps) != len(sched.prompt_targets):
            raise RuntimeError(f"runner computed no prompt logprobs for {sched.request_id!r}")
        if seq.prompt_logprobs is None:
            seq.prompt_logprobs = []
        # NOTE: by position: a chunk computed again (after a preemption) replaces its own.
        seq.prompt_logprobs[sched.start_pos:] = lps

    def _append_token(self, seq: Sequence, tok: int, lp: TokenLogprob | None = None
                      ) -> TokenOutput:
        """Append a token known now (a remote prefill's first one) and apply stops."""
        seq.token_ids.append(tok)
        return self._resolve_token(seq, len(seq.token_ids) - 1, tok, lp)

    def _resolve_token(self, seq: Sequence, pos: int, tok: int, lp: TokenLogprob | None = None
                       ) -> TokenOutput:
        """Put a sampled token at ``pos`` (where its placeholder is), check stop conditions
        as of that token, finish the sequence if one holds."""
        seq.token_ids[pos] = tok
        sp = seq.sampling
        reason: FinishReason | None = None
        drop = sp.max_tokens == 0  # the prompt only: the token drawn after it is dropped
        error = seq.grammar.advance_at(pos, tok) if seq.grammar is not None and not drop else None
        if drop:
            reason = FinishReason.LENGTH
        elif error is not None:
            reason = FinishReason.ERROR
            if self.grammar is not None:
                self.grammar.stats.errors += 1
        elif (not sp.ignore_eos and tok in self.eos_token_ids) or tok in sp.stop_token_ids:
            reason = FinishReason.STOP
        elif pos + 1 >= self.max_model_len or (
                sp.max_tokens is not None and pos + 1 - seq.num_prompt_tokens >= sp.max_tokens):
            reason = FinishReason.LENGTH
        if seq.first_token_at == 0.0 or reason is not None:
            self._time_token(seq, reason is not None)
        first = pos == seq.num_prompt_tokens
        out = self._output(seq, [tok] if error is None and not drop else [], reason)
        if error is not None:
            out.error = f"request {seq.request_id!r}: {error}"
        elif lp is not None and not drop:
            out.logprobs = [lp]
        if first and seq.prompt_logprobs is not None:
            out.prompt_logprobs, seq.prompt_logprobs = seq.prompt_logprobs, None
        if reason is not None:
            if seq.request.export_kv_from_block is not None and self.kv_exporter is not None:
                out.kv = self._export(seq)
            if seq.status is SeqStatus.WAITING:  # preempted while its last batch ran
                self.waiting.remove(seq)
            self._finish(seq, reason)
        return out

    def _time_token(self, seq: Sequence, last: bool) -> None:
        """Observe the phase a first or last token ends (choice 0 only: one per request)."""
        now = self.clock()
        first = seq.first_token_at == 0.0
        if first:
            seq.first_token_at = now
        if seq.choice != 0:
            return
        if first:
            self.timings.prefill_seconds.observe(now - seq.scheduled_at)
        if last:
            self.timings.decode_seconds.observe(now - seq.first_token_at)

    def _export(self, seq: Sequence) -> Any:
        frm = seq.request.export_kv_from_block
        assert frm is not None
        end = -(-seq.num_prompt_tokens // self.block_size)
        assert self.kv_exporter is not None
        return self.kv_exporter(seq.block_table[frm:end])

    def _output(self, seq: Sequence, toks: list[int], reason: FinishReason | None) -> TokenOutput:
        return TokenOutput(seq.request_id, toks, reason is not None, reason,
                           seq.num_prompt_tokens, seq.num_cached_tokens, index=seq.choice)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.grammar is not None:
            self.num_grammar_seqs -= 1
        self.kv.free(seq)
        if seq.penalty_slot >= 0:
            self._free_penalty_slots.append(seq.penalty_slot)
            seq.penalty_slot = -1
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        group = seq.group
        if group is not None:
            group.remove(seq)
            if group:
                return  # the request lives on in its other choices
        del self.seqs[seq.request_id]


def _token_outside(tokens: Seq[int], vocab_size: int) -> int | None:
    """The lowest token id below 0, else the highest at or above ``vocab_size``; None when
    all are inside. Packing into u32 checks the sign and width in C (4x faster than min and
    max over a list of ints: the check runs on every prompt)."""
    try:
        hi = int(np.frombuffer(array("I", tokens), dtype=np.uint32).max())
    except (OverflowError, TypeError):
        lo = min(tokens)
        return lo if lo < 0 else max(tokens)
    return hi if hi >= vocab_size else None
