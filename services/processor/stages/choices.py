"""Stage 4, ``sampling.n`` > 1: one worker stream carries every choice (``index``); each
has its own detokenizer and stop matcher and ends with its own finish delta; a last delta
carries the usage (every choice's tokens, up to where each stopped).

No migration: a worker that fails fails the request (the choices share one prefill on that
worker; moving them would need every choice's tokens resent)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from services.api.outputs import FinishReason, Usage
from services.api.processor import Delta
from services.api.route import RequestPhase, RouteResponse
from services.api.sampling import SamplingParams
from services.common.errors import Unavailable
from services.model.tokenizer import Tokenizer
from services.processor.detokenizer import IncrementalDetokenizer
from services.processor.metrics import ProcessorMetrics
from services.processor.router_reports import RouterReports
from services.processor.stages.echo import Echo
from services.processor.stages.logprobs import text_logprob
from services.processor.stages.prompt import Prompt
from services.processor.stages.route import routed_cached_tokens
from services.processor.stages.workers import WorkerLike, worker_stream
from services.processor.stop import StopMatcher


class ChoicesStage:
    def __init__(self, tokenizer: Tokenizer, workers: WorkerLike, reports: RouterReports,
                 metrics: ProcessorMetrics, block_size: int) -> None:
        self._tok = tokenizer
        self._workers = workers
        self._reports = reports
        self._metrics = metrics
        self._block_size = block_size

    async def stream(self, request_id: str, prompt: Prompt, sampling: SamplingParams,
                     route: RouteResponse, echo: Echo | None = None) -> AsyncIterator[Delta]:
        """Every choice's deltas as the worker sends them; Unavailable when the worker
        fails, aborts or sends a choice that does not exist. ``echo`` takes the prompt
        logprobs (choice 0's first output brings them, before any other choice's)."""
        ids = prompt.ids
        n = sampling.n
        detoks = [IncrementalDetokenizer(self._tok) for _ in range(n)]
        stops = [StopMatcher(sampling.stop) for _ in range(n)]
        done: list[bool] = [False] * n
        produced = 0
        cached: int | None = None
        first = True
        chunks = worker_stream(self._workers, route.address, request_id, prompt, ids, sampling)
        try:
            async for chunk in chunks:
                i = chunk.index
                if not 0 <= i < n:
                    raise Unavailable(f"decode worker {route.worker_id} sent choice {i} of {n}")
                if chunk.finish_reason is FinishReason.ABORT:
                    raise Unavailable(f"decode worker {route.worker_id} aborted the request")
                if echo is not None:
                    echo.take(chunk.prompt_logprobs)
                if chunk.finish_reason is not None:
                    cached = chunk.num_cached_tokens
                if done[i]:
                    continue  # stopped by a stop string: the engine's later tokens are dropped
                if chunk.token_ids and first:
                    first = False
                    await self._reports.send(request_id, RequestPhase.PREFILLED)
                produced += len(chunk.token_ids)
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
                    yield Delta(text, reason, logprobs=lps, index=i)
                    if all(done):
                        break
                elif text or lps:
                    yield Delta(text, logprobs=lps, index=i)
            else:
                if not all(done):
                    raise Unavailable(f"decode worker {route.worker_id} ended the stream unfinished")
        finally:
            await chunks.aclose()  # cancels the worker call when every choice stopped early
        if cached is None:
            cached = routed_cached_tokens(route, self._block_size, prompt)
        yield Delta("", usage=Usage(len(ids), produced, cached))
