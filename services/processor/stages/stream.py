"""Stage 4, one choice: the decode worker's tokens as text deltas, moved to another worker
when the one streaming fails or drains, so the client sees one uninterrupted stream.

Greedy requests continue exactly; seeded ones too (the worker continues the seeded draw
sequence at the produced count). The detokenizer and stop matcher live here, across
workers, so the text continues with nothing repeated or lost; a grammar's matcher replays
the produced tokens on the next worker (engine/scheduler.py). A draining worker's request
goes on with its KV pulled from there (``move_from``) rather than prefilled again.

A choice of an n > 1 request whose shared worker failed continues here alone (``Resume``):
its own request id, its own seed (``SamplingParams.for_choice``), what it produced so far."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from services.api.move import MoveSource
from services.api.outputs import FinishReason, TokenOutput, Usage
from services.api.processor import Delta, TextLogprob
from services.api.route import RequestPhase, RouteResponse
from services.api.sampling import SamplingParams
from services.common.errors import (
    GenerationFailed,
    InvalidRequest,
    Overloaded,
    RequestMoved,
    ServingError,
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
from services.processor.stages.workers import WorkerLike, worker_stream
from services.processor.stop import StopMatcher


@dataclass
class Resume:
    """Choice ``index`` of an n > 1 request, cut off when its worker failed (``failure``;
    ``overloaded``: refused, its queue full; ``moved``: it drained): the tokens it produced
    there and its detokenizer, fed with them."""

    index: int
    produced: list[int]
    detok: IncrementalDetokenizer
    failure: str
    overloaded: bool = False
    moved: bool = False


class StreamStage:
    def __init__(self, tokenizer: Tokenizer, workers: WorkerLike, routes: RouteStage,
                 reports: RouterReports, metrics: ProcessorMetrics, migration_limit: int) -> None:
        self._tok = tokenizer
        self._workers = workers
        self._routes = routes
        self._reports = reports
        self._metrics = metrics
        self._migration_limit = migration_limit

    async def stream(self, request_id: str, prompt: Prompt, sampling: SamplingParams,
                     stops: StopMatcher, route: RouteResponse, echo: Echo | None = None,
                     resume: Resume | None = None) -> AsyncIterator[Delta]:
        """Stream from ``route``'s worker; when it fails (dies, refuses, ends the stream
        without a finish or aborts), migrate: route ``ids + produced`` again excluding the
        failed workers, with ``max_tokens`` less what was produced and the seeded draws
        continued (and no prompt logprobs asked again: they came with the first token).
        When the worker drains (RequestMoved) the same happens, and the next worker gets
        ``move_from`` (where the KV waits) until one of them streams a token.
        The last delta carries the finish reason and the usage; ``echo`` takes the prompt
        logprobs. ``resume``: a choice whose worker (``route``'s) failed; it moves at once,
        its deltas carry its index and its usage counts its tokens only."""
        ids = prompt.ids
        limit = sampling.max_tokens
        assert limit is not None  # resolved by the sampling stage
        migration = Migration(self._routes, self._reports, self._metrics, self._migration_limit,
                              request_id, prompt)
        detok = IncrementalDetokenizer(self._tok) if resume is None else resume.detok
        produced: list[int] = [] if resume is None else resume.produced
        index = 0 if resume is None else resume.index
        if resume is not None:
            route = await migration.move(route, produced, resume.failure, resume.overloaded,
                                         resume.moved)
        tail = ""  # text that goes out with the finish reason
        lps: list[TextLogprob] = []  # logprobs not sent yet: they go with the next delta
        last: TokenOutput | None = None
        move_from: MoveSource | None = None
        moved_at = 0.0  # when the last move's message came (0.0: none pending)
        while True:
            attempt_ids = ids + produced if produced else ids
            attempt_sp = replace(sampling, max_tokens=limit - len(produced),
                                 seed_step_offset=sampling.seed_step_offset + len(produced),
                                 prompt_logprobs=None if produced else sampling.prompt_logprobs)
            chunks = worker_stream(self._workers, route.address, request_id, prompt, attempt_ids,
                                   attempt_sp, move_from)
            failure: str | None = None
            overloaded = moved = False
            first = True
            try:
                async for chunk in chunks:
                    if echo is not None:
                        echo.take(chunk.prompt_logprobs)
                    if chunk.token_ids:
                        if first:
                            first = False
                            move_from = None  # used: a later failure replays
                            if moved_at:
                                self._metrics.move_gap.observe(time.monotonic() - moved_at)
                                moved_at = 0.0
                            await self._reports.send(request_id, RequestPhase.PREFILLED)
                        produced.extend(chunk.token_ids)
                        self._metrics.completion_tokens.inc(len(chunk.token_ids))
                        if chunk.logprobs:
                            lps.extend(text_logprob(self._tok, x) for x in chunk.logprobs)
                        text = stops.feed(detok.add(chunk.token_ids))
                        if stops.stopped or chunk.finish_reason is not None:
                            tail = text
                        elif text:
                            yield Delta(text, logprobs=tuple(lps), index=index,
                                        tokens=len(produced), prompt_tokens=len(ids))
                            lps.clear()
                    if stops.stopped:
                        break
                    if chunk.finish_reason is not None:
                        last = chunk
                        break
                else:
                    failure = "ended the stream unfinished"
            except (InvalidRequest, GenerationFailed):
                raise  # the request itself is bad: another worker would refuse or fail it too
            except RequestMoved as e:
                failure, moved, move_from = e.message, True, e.source
                self._metrics.moves.labels("kv" if e.source is not None else "replay").inc()
                moved_at = time.monotonic()
            except Overloaded as e:
                failure, overloaded = e.message, True
            except ServingError as e:
                failure = e.message
            finally:
                await chunks.aclose()  # cancels the worker call when we stopped early
            if failure is None and last is not None and last.finish_reason is FinishReason.ABORT:
                failure, last = "aborted the request", None
            if failure is None:
                break
            if limit and len(produced) >= limit:
                # NOTE: the worker died after its last token but before the finish message
                # (max_tokens 0 has none: it moves, for the prompt logprobs it asked).
                last = TokenOutput(request_id, [], True, FinishReason.LENGTH, len(ids))
                break
            route = await migration.move(route, produced, failure, overloaded, moved)
        if stops.stopped:
            # NOTE: we cancelled the worker before its final usage: the cached count is the
            # router's view of the prefix this worker held.
            cached = routed_cached_tokens(route, self._routes.block_size, prompt)
            yield Delta(tail, FinishReason.STOP, Usage(len(ids), len(produced), cached),
                        logprobs=tuple(lps), index=index, tokens=len(produced),
                        prompt_tokens=len(ids))
            return
        assert last is not None
        tail += stops.feed(detok.flush())
        tail += stops.flush()
        reason = (FinishReason.STOP if stops.stopped or last.finish_reason is FinishReason.STOP
                  else FinishReason.LENGTH)
        cached = (routed_cached_tokens(route, self._routes.block_size, prompt) if migration.moved
                  else last.num_cached_tokens)
        yield Delta(tail, reason, Usage(len(ids), len(produced), cached), logprobs=tuple(lps),
                    index=index, tokens=len(produced), prompt_tokens=len(ids))
