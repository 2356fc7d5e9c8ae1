"""asyncio front of the engine: one dedicated step thread owns the (non thread-safe) LLMEngine.

asyncio code never touches the engine directly: ``add``/``abort``/remote-prefill calls are
queued as commands and applied by the step thread between steps, in order. Outputs go
back to per-request ``asyncio.Queue``s through ``loop.call_soon_threadsafe`` (one call per
step). The thread sleeps on a condition when it has nothing to do (no busy loop).

If the step loop raises, every in-flight request and pending call fails with
``EngineDeadError`` (never hangs) and later calls raise it at once.

A request is checked once, by its entry (a worker, `tandem chat`) calling ``validate``;
``generate`` and ``begin_remote_prefill`` trust that and refuse only an id already live.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Literal, TypeVar

from services.api.kv_events import KvEvent
from services.api.outputs import FinishReason, TokenLogprob, TokenOutput
from services.common.errors import GenerationFailed, Unavailable
from services.engine.engine import EngineStats, LLMEngine
from services.engine.move import MoveHold
from services.engine.remote_prefill import RemotePrefillHandle
from services.engine.request import GenerateRequest
from services.engine.runner.base import KvSpec
from services.engine.scheduler import InvalidRequestError

T = TypeVar("T")

# engine.stream_interval "auto" (docs/benchmarks.md "Tokens per message"): two tokens a
# message once a step carries this many sequences. With 16 and 32 streams of short prompts
# on a 2-vCPU machine served output rose 9-15% and 3-13% (8 streams: within the spread);
# below, each token goes out as it is made, as a client timing its gaps expects.
AUTO_STREAM_SEQS = 16
AUTO_STREAM_INTERVAL = 2


class EngineDeadError(Unavailable):
    """The engine's step loop failed or was shut down; the request cannot continue."""


class RequestMoving(Exception):  # noqa: N818 (a lifecycle event, not a failure)
    """Ends the stream of a request taken off this engine's schedule by ``hold_for_move``:
    ``held`` (its KV waits for an export) or handed back (nothing of it is kept)."""

    def __init__(self, request_id: str, held: bool) -> None:
        super().__init__(f"request {request_id!r} {'is held to move' if held else 'was handed back'}")
        self.request_id = request_id
        self.held = held


# (function run on the step thread, its args, future for its result, request it concerns)
_Command = tuple[Callable[..., Any], tuple[Any, ...], "asyncio.Future[Any] | None", "str | None"]


class AsyncEngine:
    """Owns an LLMEngine and its step thread. Use ``async with AsyncEngine(engine) as ae``
    (or ``await start()`` / ``await shutdown()``)."""

    def __init__(self, engine: LLMEngine, stream_interval: int | Literal["auto"] = 1) -> None:
        """``stream_interval``: after a choice's first token, its tokens are handed on
        together once this many are made (or it ended). Each output is a message through
        every hop to the client, whose CPU a loaded CPU machine takes from the engine.
        "auto": ``AUTO_STREAM_INTERVAL`` in steps of ``AUTO_STREAM_SEQS`` sequences or
        more, else 1 (each token as it is made)."""
        if stream_interval != "auto" and stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1 or 'auto', got {stream_interval}")
        self.engine = engine
        self.stream_interval = stream_interval
        # stream_interval's state, on the event loop only: by request and choice, the tokens
        # made and not yet queued (as of the last step), and which choices have queued their
        # first token.
        self._held: dict[str, dict[int, TokenOutput]] = {}
        self._started: dict[str, set[int]] = {}
        self._cond = threading.Condition()
        self._commands: list[_Command] = []
        self._queues: dict[str, asyncio.Queue[TokenOutput | BaseException]] = {}
        self._choices: dict[str, int] = {}  # registered requests' n, until stream() reads it
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._error: BaseException | None = None
        # Prompt tokens of requests submitted and not yet added on the step thread (which
        # takes commands between steps): stats() counts them pending, so a decision taken
        # meanwhile (a burst's) sees them.
        self._adding_lock = threading.Lock()
        self._adding_tokens = 0

    # ---- lifecycle ------------------------------------------------------------------
    async def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("AsyncEngine already started")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine-step", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        """Stop the step thread; in-flight requests fail with EngineDeadError."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        if self._error is None:
            self._error = EngineDeadError("engine shut down")
        with self._cond:
            pending, self._commands = self._commands, []
        for _, _, fut, _ in pending:
            if fut is not None:
                _set_exception(fut, EngineDeadError(str(self._error)))
        self._fail_all(self._error)

    async def __aenter__(self) -> AsyncEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    @property
    def error(self) -> BaseException | None:
        return self._error

    @property
    def kv_spec(self) -> KvSpec:
        """The shape and dtype of this engine's KV blocks (fixed at construction)."""
        return self.engine.runner.kv_spec

    # ---- requests -------------------------------------------------------------------
    def validate(self, request: GenerateRequest) -> None:
        """Raise InvalidRequestError if the request can never be served: the entry check,
        run on the caller's thread (it reads config only), before ``generate`` or
        ``begin_remote_prefill``."""
        self.engine.validate(request)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenOutput]:
        """Stream the outputs of a validated request until one is finished.

        Raises InvalidRequestError if its id is live, EngineDeadError if the engine dies.
        Closing the generator early (break + aclose, task cancelled) aborts the request.
        """
        self._check_alive()
        self._register(request.request_id, request.sampling.n)
        n = len(request.prompt_token_ids)
        with self._adding_lock:
            self._adding_tokens += n
        self._submit(self._add, (request, n), None, request.request_id)
        # NOTE: close the inner stream explicitly: left to the event loop's async-generator
        # finalizer, the abort it queues would come a loop iteration (and steps) late.
        async with contextlib.aclosing(self.stream(request.request_id)) as outputs:
            async for out in outputs:
                yield out

    async def stream(self, request_id: str) -> AsyncIterator[TokenOutput]:
        """Outputs of a request registered by ``generate`` or ``begin_remote_prefill``, until
        each of its ``n`` choices finished (or it was aborted)."""
        q = self._queues.get(request_id)
        if q is None:
            raise KeyError(f"request {request_id!r} is not registered with this engine")
        left = self._choices.pop(request_id, 1)
        finished = False
        try:
            while True:
                item = await q.get()
                if not q.empty() and isinstance(item, TokenOutput):
                    item = _coalesce(item, q)
                if isinstance(item, RequestMoving):
                    finished = True  # held or aborted already: nothing to abort
                    raise item
                if isinstance(item, BaseException):
                    # NOTE: one choice failed (its grammar): the others, still live, are
                    # aborted by the finally below.
                    finished = left <= 1
                    raise item
                if item.finished:
                    left -= 1
                    finished = left == 0 or item.finish_reason is FinishReason.ABORT
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            self._held.pop(request_id, None)
            self._started.pop(request_id, None)
            if not finished and self._error is None:
                self._submit(self.engine.abort, (request_id,), None, None)

    async def abort(self, request_id: str) -> None:
        """Abort a live request; its stream ends with a finished ABORT output."""
        self._check_alive()
        self._submit(self.engine.abort, (request_id,), None, None)

    # ---- disaggregation (decode side) -----------------------------------------------
    async def begin_remote_prefill(self, request: GenerateRequest) -> RemotePrefillHandle | None:
        """Park a validated request (see Scheduler.begin_remote_prefill); then read
        ``stream(id)``.

        None: its blocks do not fit now; the caller prefills locally with ``generate``.
        """
        self._check_alive()
        self._register(request.request_id, request.sampling.n)
        try:
            handle = await self.call(lambda e: e.begin_remote_prefill(request))
        except BaseException:
            self._queues.pop(request.request_id, None)
            self._choices.pop(request.request_id, None)
            raise
        if handle is None:
            self._queues.pop(request.request_id, None)
            self._choices.pop(request.request_id, None)
        return handle

    async def complete_remote_prefill(
        self, request_id: str, kv: Any, first_token: int, first_logprob: TokenLogprob | None = None
    ) -> TokenOutput | None:
        """Import remote KV; the first token also goes to the stream. Raises RemoteKvError."""
        return await self.call(
            lambda e: e.complete_remote_prefill(request_id, kv, first_token, first_logprob))

    async def fail_remote_prefill(self, request_id: str) -> bool:
        return await self.call(lambda e: e.fail_remote_prefill(request_id))

    # ---- moves off a draining worker (services/decode/move_out.py) ---------------------
    async def hold_for_move(self) -> MoveHold:
        """Hold every request that can move and abort the rest (LLMEngine.hold_for_move);
        the outputs of the batch that was in flight are streamed first. Their streams go on
        until ``end_moved_streams``."""
        hold = await self.call(lambda e: e.hold_for_move())
        self._dispatch(hold.outputs)
        return hold

    def end_moved_streams(self, hold: MoveHold) -> None:
        """End each stream of ``hold`` with RequestMoving (held or handed back)."""
        for h in hold.held:
            self._deliver(h.request_id, RequestMoving(h.request_id, True))
        for rid in hold.handed_back:
            self._deliver(rid, RequestMoving(rid, False))

    def release_held(self, request_id: str) -> None:
        """Free a held request's blocks (an abort; sync, so a ``finally`` may call it).
        Nothing to do once the engine is dead."""
        if self._error is None and self._thread is not None:
            self._submit(self.engine.abort, (request_id,), None, None)

    async def export_held(self, request_id: str, first_block: int, num_blocks: int,
                          num_tokens: int) -> tuple[Any, int]:
        """(KV copy, last token) of a held request (Scheduler.export_held)."""
        return await self.call(
            lambda e: e.export_held(request_id, first_block, num_blocks, num_tokens))

    def prefix_hit_tokens(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens of a prompt the prefix cache serves, read without waiting
        for the step thread (as ``stats``): a decision made during a long prefill step must
        not wait for its end. A pure query of one dict per block, whose single lookups are
        atomic; the step thread may change the cache between two of them, so the answer
        is a hint a step old at most, as any answer is once the caller acts on it."""
        return self.engine.prefix_hit_tokens(token_ids)

    async def dump_kv_events(self) -> list[KvEvent]:
        return await self.call(lambda e: e.dump_kv_events())

    async def reset_prefix_cache(self) -> tuple[int, int]:
        """``LLMEngine.reset_prefix_cache`` on the step thread, between steps."""
        return await self.call(lambda e: e.reset_prefix_cache())

    async def check_integrity(self) -> None:
        await self.call(lambda e: e.check_integrity())

    def stats(self) -> EngineStats:
        """A snapshot read without waiting for the step thread (counters may be one step
        apart); prompts submitted and not yet taken by it count as prefill pending."""
        s = self.engine.stats()
        adding = self._adding_tokens
        if adding:
            s = dataclasses.replace(s, num_prefill_tokens_pending=s.num_prefill_tokens_pending + adding)
        return s

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the step thread between steps, after earlier commands."""
        self._check_alive()
        assert self._loop is not None
        fut: asyncio.Future[T] = self._loop.create_future()
        self._submit(fn, (self.engine,), fut, None)
        return await fut

    # ---- plumbing -------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"engine is not running: {self._error}") from self._error
        if self._thread is None:
            raise RuntimeError("AsyncEngine not started: use `async with` or await start()")

    def _register(self, request_id: str, n: int = 1) -> None:
        if request_id in self._queues:
            raise InvalidRequestError(f"request {request_id!r}: a request with this id is already live")
        self._queues[request_id] = asyncio.Queue()
        self._choices[request_id] = n

    def _add(self, request: GenerateRequest, n: int) -> Any:
        """``generate``'s command (step thread)."""
        try:
            return self.engine.add_request(request)
        finally:
            with self._adding_lock:
                self._adding_tokens -= n

    def _submit(self, fn: Callable[..., Any], args: tuple[Any, ...],
                fut: asyncio.Future[Any] | None, request_id: str | None) -> None:
        with self._cond:
            self._commands.append((fn, args, fut, request_id))
            self._cond.notify()

    def _run(self) -> None:
        """The step thread: apply queued commands, step while there is work, else sleep."""
        engine, cond, loop = self.engine, self._cond, self._loop
        assert loop is not None
        progress = True  # NOTE: a step that scheduled nothing waits for the next command
        try:
            while True:
                with cond:
                    while not (self._commands or self._stopping
                               or (progress and engine.has_schedulable())):
                        cond.wait()
                    if self._stopping:
                        return
                    cmds, self._commands = self._commands, []
                outputs: list[TokenOutput] = []
                for fn, args, fut, rid in cmds:
                    try:
                        res = fn(*args)
                    except Exception as e:  # a bad command fails its caller, not the engine
                        self._post_error(fut, rid, e)
                        continue
                    if isinstance(res, TokenOutput):
                        outputs.append(res)
                    if fut is not None:
                        loop.call_soon_threadsafe(_set_result, fut, res)
                if cmds:
                    progress = True
                if engine.has_schedulable():
                    outputs.extend(engine.step())
                    progress = engine.last_batch_size > 0
                if outputs:
                    loop.call_soon_threadsafe(self._dispatch, outputs)
        except BaseException as e:
            err = EngineDeadError(f"engine step loop failed: {e!r}")
            err.__cause__ = e
            self._error = err
            with cond:
                pending, self._commands = self._commands, []
            for _, _, fut, _ in pending:
                if fut is not None:
                    loop.call_soon_threadsafe(_set_exception, fut, err)
            loop.call_soon_threadsafe(self._fail_all, err)

    def _post_error(self, fut: asyncio.Future[Any] | None, rid: str | None, e: Exception) -> None:
        assert self._loop is not None
        if fut is not None:
            self._loop.call_soon_threadsafe(_set_exception, fut, e)
        elif rid is not None:
            self._loop.call_soon_threadsafe(self._deliver, rid, e)

    def _deliver(self, rid: str, item: TokenOutput | BaseException) -> None:
        q = self._queues.get(rid)
        if q is not None:
            held = self._held.pop(rid, None)
            if held:  # the tokens made before it go first (a moved request's included)
                for out in held.values():
                    q.put_nowait(out)
            q.put_nowait(item)

    def _dispatch(self, outputs: list[TokenOutput]) -> None:
        queues, k = self._queues, self.stream_interval
        if k == "auto":
            k = AUTO_STREAM_INTERVAL if len(outputs) >= AUTO_STREAM_SEQS else 1
        if k > 1 or self._held:
            self._dispatch_held(outputs, k)
            return
        for out in outputs:
            q = queues.get(out.request_id)
            if q is not None:
                q.put_nowait(out if out.error is None else GenerationFailed(out.error))

    def _dispatch_held(self, outputs: list[TokenOutput], k: int) -> None:
        """``_dispatch`` with a stream interval ``k``: after a choice's first token, its
        plain continuations wait here (no wakeup, no message) until they are ``k`` tokens,
        the choice ends, or a step passes without a token of it (preempted, migrating:
        what was made goes out rather than waiting on it)."""
        queues, started = self._queues, self._started
        waited, held = self._held, {}  # what this step does not continue is released below
        self._held = held
        for out in outputs:
            rid = out.request_id
            q = queues.get(rid)
            if q is None:
                continue
            mine = waited.get(rid)
            before = mine.pop(out.index, None) if mine else None
            if before is not None:
                if _mergeable(before, out):
                    out = _merged(before, out, copy=False)
                else:
                    q.put_nowait(before)
            seen = started.setdefault(rid, set())
            if (out.index in seen and _open(out) and len(out.token_ids) < k
                    and out.prompt_logprobs is None):
                held.setdefault(rid, {})[out.index] = out if before is not None else _owned(out)
                continue
            seen.add(out.index)
            q.put_nowait(out if out.error is None else GenerationFailed(out.error))
        for rid, by_index in waited.items():
            q = queues.get(rid)
            if q is not None:
                for out in by_index.values():
                    q.put_nowait(out)

    def _fail_all(self, err: BaseException) -> None:
        for q in self._queues.values():
            e = EngineDeadError(str(err))  # one instance per request: each gets its traceback
            e.__cause__ = err.__cause__ or err
            q.put_nowait(e)


def _coalesce(first: TokenOutput, q: asyncio.Queue[TokenOutput | BaseException]) -> TokenOutput:
    """``first`` with the tokens queued behind it of the same choice, as one output.

    A consumer that falls behind the engine (a loaded machine, a slow client) then sends one
    message per wakeup instead of one per token through every hop after this one; one that
    keeps up still gets each token as it is made. Stops at anything that is not a plain
    continuation (another choice, an error or abort, a finish carried by ``first``)."""
    out = first
    while not q.empty() and _open(out):
        nxt = q._queue[0]  # type: ignore[attr-defined]  # NOTE: peek: asyncio.Queue has no public one
        if not _mergeable(out, nxt):
            break
        q.get_nowait()
        out = _merged(out, nxt, copy=out is first)
    return out


def _open(out: TokenOutput) -> bool:
    return not out.finished and out.error is None


def _mergeable(out: TokenOutput, nxt: TokenOutput | BaseException) -> bool:
    """Whether ``nxt`` plainly continues ``out`` (an open output): same choice, no error,
    abort or prompt logprobs, logprobs on both or neither."""
    return (isinstance(nxt, TokenOutput) and nxt.index == out.index and nxt.prompt_logprobs is None
            and nxt.error is None and nxt.finish_reason is not FinishReason.ABORT
            and (nxt.logprobs is None) == (out.logprobs is None))


def _owned(out: TokenOutput) -> TokenOutput:
    """A copy of ``out`` whose token and logprob lists may be extended."""
    return dataclasses.replace(out, token_ids=list(out.token_ids),
                               logprobs=list(out.logprobs) if out.logprobs is not None else None)


def _merged(out: TokenOutput, nxt: TokenOutput, copy: bool = True) -> TokenOutput:
    """``out`` followed by ``nxt``'s tokens and end state (a copy of ``out`` unless ``copy``
    is false: an output already merged into belongs to the stream alone)."""
    if copy:
        out = _owned(out)
    out.token_ids.extend(nxt.token_ids)
    if out.logprobs is not None and nxt.logprobs is not None:
        out.logprobs.extend(nxt.logprobs)
    out.finished, out.finish_reason, out.kv, out.error = nxt.finished, nxt.finish_reason, nxt.kv, nxt.error
    out.num_prompt_tokens, out.num_cached_tokens = nxt.num_prompt_tokens, nxt.num_cached_tokens
    return out


def _set_result(fut: asyncio.Future[Any], value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future[Any], err: BaseException) -> None:
    if not fut.done():
        fut.set_exception(err)
