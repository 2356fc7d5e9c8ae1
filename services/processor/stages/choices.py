"""Stage 4, ``sampling.n`` > 1: one worker stream carries every choice (``index``); each
has its own detokenizer and stop matcher and ends with its own finish delta; a last delta
carries the usage (every choice's tokens, up to where each stopped).

When that worker fails or drains before any choice produced a token (a refused start),
the whole request goes to another worker, its choices still sharing one prefill. After
that, every unfinished choice continues alone on another worker, as a one-choice request (``StreamStage`` with a ``Resume``) under its own request
id (``<id>.<choice>``): its prompt followed by what it produced, its own seed continued at
its own position, its grammar replayed. The continuations run at once, their deltas
interleaved as they come."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace

from services.api.outputs import FinishReason, Usage
from services.api.processor import Delta
from services.api.route import RequestPhase, RouteResponse
from services.api.sampling import SamplingParams
from services.common.errors import (
    GenerationFailed,
    InvalidRequest,
    Overloaded,
    RequestMoved,
    ServingError,
    Unavailable,
)
from services.model.tokenizer import Tokenizer
from services.processor.detokenizer import IncrementalDetokenizer
from services.processor.metrics import ProcessorMetrics
from services.processor.router_reports import RouterReports
from services.processor.stages.echo import Echo
from services.processor.stages.logprobs import text_logprob
from services.processor.stages.migrate import Migration
from services.processor.stages.prompt import Prompt
from services.processor.stages.route import RouteStage, routed_cached_tokens
from services.processor.stages.stream import Resume, StreamStage
from services.processor.stages.workers import WorkerLike, worker_stream
from services.processor.stop import StopMatcher


class ChoicesStage:
    def __init__(self, tokenizer: Tokenizer, workers: WorkerLike, routes: RouteStage,
                 reports: RouterReports, metrics: ProcessorMetrics, migration_limit: int,
                 single: StreamStage) -> None:
        self._tok = tokenizer
        self._workers = workers
        self._routes = routes
        self._reports = reports
        self._metrics = metrics
        self._migration_limit = migration_limit
        self._single = single  # continues a choice alone when the shared worker fails

    async def stream(self, request_id: str, prompt: Prompt, sampling: SamplingParams,
                     route: RouteResponse, echo: Echo | None = None) -> AsyncIterator[Delta]:
        """Every choice's deltas as the worker sends them; when the worker fails, aborts or
        drains, the unfinished choices' deltas from the workers that continue them
        (Unavailable when none can). ``echo`` takes the prompt logprobs (choice 0's first
        output brings them, before any other choice's)."""
        ids = prompt.ids
        n = sampling.n
        detoks = [IncrementalDetokenizer(self._tok) for _ in range(n)]
        stops = [StopMatcher(sampling.stop) for _ in range(n)]
        done: list[bool] = [False] * n
        toks: list[list[int]] = [[] for _ in range(n)]  # each choice's tokens so far
        cached: int | None = None
        first = True
        migration = Migration(self._routes, self._reports, self._metrics, self._migration_limit,
                              request_id, prompt)
        while True:
            failure: str | None = None
            overloaded = moved = False
            chunks = worker_stream(self._workers, route.address, request_id, prompt, ids, sampling)
            try:
                async for chunk in chunks:
                    i = chunk.index
                    if not 0 <= i < n:
                        raise Unavailable(f"decode worker {route.worker_id} sent choice {i} of {n}")
                    if chunk.finish_reason is FinishReason.ABORT:
                        failure = "aborted the request"
                        break
                    if echo is not None:
                        echo.take(chunk.prompt_logprobs)
                    if chunk.finish_reason is not None:
                        cached = chunk.num_cached_tokens
                    if done[i]:
                        continue  # stopped by a stop string: the engine's later tokens are dropped
                    if chunk.token_ids and first:
                        first = False
                        await self._reports.send(request_id, RequestPhase.PREFILLED)
                    toks[i].extend(chunk.token_ids)
                    self._metrics.completion_tokens.inc(len(chunk.token_ids))
                    lps = tuple(text_logprob(self._tok, x) for x in chunk.logprobs or ())
                    text = stops[i].feed(detoks[i].add(chunk.token_ids))
                    if not stops[i].stopped and chunk.finish_reason is not None:
                        text += stops[i].feed(detoks[i].flush())
                        text += stops[i].flush()
                    if stops[i].stopped or chunk.finish_reason is not None:
                        done[i] = True
                        reason = (FinishReason.STOP if stops[i].stopped
                                  or chunk.finish_reason is FinishReason.STOP else FinishReason.LENGTH)
                        yield Delta(text, reason, logprobs=lps, index=i, tokens=len(toks[i]),
                                    prompt_tokens=len(ids))
                        if all(done):
                            break
                    elif text or lps:
                        yield Delta(text, logprobs=lps, index=i, tokens=len(toks[i]),
                                    prompt_tokens=len(ids))
                else:
                    if not all(done):
                        failure = "ended the stream unfinished"
            except (InvalidRequest, GenerationFailed):
                raise  # the request itself is bad: another worker would refuse or fail it too
            except RequestMoved as e:
                # NOTE: a draining worker hands n > 1 back by replay (no KV source).
                failure, moved = e.message, True
                self._metrics.moves.labels("replay").inc()
            except Overloaded as e:
                failure, overloaded = e.message, True
            except ServingError as e:
                failure = e.message
            finally:
                await chunks.aclose()  # cancels the worker call when every choice stopped early
            if failure is None or any(toks) or any(done):
                break
            # Nothing produced yet (a refused start): the whole request moves, its choices
            # still sharing one prefill.
            route = await migration.move(route, [], failure, overloaded, moved)
        counts = [len(t) for t in toks]
        if failure is not None:
            # The failed worker no longer carries this request's load.
            await self._reports.send_now(request_id, RequestPhase.FINISHED)
            rest: list[AsyncIterator[Delta]] = []
            for i in (i for i in range(n) if not done[i]):
                assert sampling.max_tokens is not None  # resolved by the sampling stage
                if len(toks[i]) >= sampling.max_tokens:
                    # NOTE: the worker failed after the choice's last token, before its finish.
                    text = stops[i].feed(detoks[i].flush()) + stops[i].flush()
                    yield Delta(text, FinishReason.STOP if stops[i].stopped else FinishReason.LENGTH,
                                index=i, tokens=len(toks[i]), prompt_tokens=len(ids))
                    continue
                resume = Resume(i, toks[i], detoks[i], failure, overloaded, moved)
                rest.append(self._continue(f"{request_id}.{i}", prompt, sampling.for_choice(i),
                                           stops[i], route, echo, resume))
            async for d in _interleave(rest):
                if d.usage is not None:
                    counts[d.index] = d.usage.completion_tokens
                    d = replace(d, usage=None)
                yield d
        if cached is None:
            cached = routed_cached_tokens(route, self._routes.block_size, prompt)
        yield Delta("", usage=Usage(len(ids), sum(counts), cached), prompt_tokens=len(ids))

    async def _continue(self, sub_id: str, prompt: Prompt, sampling: SamplingParams,
                        stops: StopMatcher, route: RouteResponse, echo: Echo | None,
                        resume: Resume) -> AsyncIterator[Delta]:
        """One choice continued alone as ``sub_id``; its load leaves the router at its end."""
        try:
            async for d in self._single.stream(sub_id, prompt, sampling, stops, route, echo,
                                               resume):
                yield d
        finally:
            await self._reports.send_now(sub_id, RequestPhase.FINISHED)


_END = object()  # a stream ended


async def _interleave(streams: Sequence[AsyncIterator[Delta]]) -> AsyncIterator[Delta]:
    """The deltas of every stream as they come; the first error ends it (and them all).
    Closing it cancels every stream."""
    queue: asyncio.Queue[Delta | BaseException | object] = asyncio.Queue()

    async def pump(s: AsyncIterator[Delta]) -> None:
        try:
            async with contextlib.aclosing(s) as deltas:
                async for d in deltas:
                    queue.put_nowait(d)
            queue.put_nowait(_END)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait(e)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        ended = 0
        while ended < len(tasks):
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item is _END:
                ended += 1
            else:
                assert isinstance(item, Delta)
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
