"""The Processor part: text in, text deltas out.

``generate(ProcessRequest)`` renders the chat template, tokenizes, checks the prompt against
the context, asks the router for a decode worker, streams that worker's tokens over gRPC,
detokenizes incrementally, applies stop strings and counts usage. The router is the
in-process ``Router`` or a ``RouterClient`` (same ``route``/``update``); routes carry the
prompt's local block hashes (at ``block_size``), computed here rather than in the router.

Router bookkeeping: ``update(PREFILLED)`` at the first token, ``update(FINISHED)`` at the end
whatever the end was (finish, stop string, error, cancellation), so no load leaks. A deployed
processor publishes both on NATS, so neither holds up a token: see ``RouterReports``.

Migration: a stream whose decode worker fails mid-way continues on another worker (see
``_stream``); the client sees one uninterrupted stream. Greedy requests continue exactly;
seeded ones too (the worker continues the seeded draw sequence at the produced count).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import Protocol

from services.api.images import PromptImage
from services.api.outputs import FinishReason, TokenLogprob, TokenOutput, Usage
from services.api.processor import CHAT_ROLES, Delta, ModelInfo, ProcessRequest, TextLogprob
from services.api.route import RequestPhase, RouteRequest, RouteResponse
from services.api.sampling import SamplingParams
from services.common.errors import (
    GenerationFailed,
    InvalidRequest,
    ModelNotFound,
    Overloaded,
    ServingError,
    Unavailable,
)
from services.common.hashing import local_block_hashes
from services.model.chat_template import ChatTemplateError
from services.model.tokenizer import Tokenizer
from services.processor.detokenizer import IncrementalDetokenizer
from services.processor.images import ImagePrompting
from services.processor.metrics import ProcessorMetrics
from services.processor.router_reports import Publish, RouterLike, RouterReports
from services.processor.stop import StopMatcher
from services.processor.tools import ToolCallParser, tool_dicts, with_tool_prompt
from services.processor.worker_client import DecodeWorkerClient

log = logging.getLogger(__name__)


class WorkerLike(Protocol):
    def generate(self, address: str, request_id: str, token_ids: Sequence[int],
                 sampling: SamplingParams, images: tuple[PromptImage, ...] = ()) -> AsyncIterator[TokenOutput]: ...


class Processor:
    def __init__(
        self,
        tokenizer: Tokenizer,
        router: RouterLike,
        workers: WorkerLike | DecodeWorkerClient,
        model_name: str,
        context_length: int,
        block_size: int = 16,
        metrics: ProcessorMetrics | None = None,
        migration_limit: int = 3,
        publish_reports: Publish | None = None,
        instance: str = "processor",
        images: ImagePrompting | None = None,
    ) -> None:
        self._tok = tokenizer
        self._router = router
        self.reports = RouterReports(router, publish_reports, instance)
        self._workers = workers
        self.model_name = model_name
        self.context_length = context_length
        self._block_size = block_size
        self.metrics = metrics if metrics is not None else ProcessorMetrics()
        self.migration_limit = migration_limit
        self._images = images  # None: a text-only model

    async def list_models(self) -> list[ModelInfo]:
        return [ModelInfo(self.model_name, self.context_length)]

    async def generate(self, req: ProcessRequest) -> AsyncIterator[Delta]:
        """Stream the answer. Raises InvalidRequest, ModelNotFound or Unavailable before the
        first delta for a request that cannot start; closing the iterator aborts it."""
        m = self.metrics
        try:
            ids, images = self._prompt(req)
            sampling = self._sampling(req, len(ids))
            try:
                stops = StopMatcher(req.sampling.stop)
            except ValueError as e:
                raise InvalidRequest(str(e), param="stop") from None
            route = await self._route(req.request_id, ids, images=images)
        except ServingError as e:
            m.requests.labels(e.kind).inc()
            raise
        m.prompt_tokens.inc(len(ids))
        m.inflight.inc()
        outcome = "cancelled"
        released = False
        # One tool-call parser per choice (made as the choice's first delta comes).
        parsers: dict[int, ToolCallParser] | None = (
            {} if req.tools and req.tool_choice.mode != "none" else None)
        try:
            stream = (self._stream(req.request_id, ids, sampling, stops, route, images)
                      if sampling.n == 1
                      else self._stream_choices(req.request_id, ids, sampling, route, images))
            async for delta in stream:
                if parsers is not None:
                    parser = parsers.get(delta.index)
                    if parser is None:
                        parser = parsers[delta.index] = ToolCallParser(req.tools, req.tool_choice)
                    delta = _with_tool_calls(parser, delta)
                    if (not delta.text and not delta.logprobs and delta.finish_reason is None
                            and delta.usage is None):
                        continue
                if delta.finish_reason is not None:
                    outcome = delta.finish_reason.value
                if delta.usage is not None:  # the request's last delta
                    released = True
                    await self.reports.send(req.request_id, RequestPhase.FINISHED)
                yield delta
        except ServingError as e:
            outcome = e.kind
            raise
        except Exception:
            outcome = "error"
            raise
        finally:
            m.inflight.dec()
            m.requests.labels(outcome).inc()
            if not released:
                await self.reports.send(req.request_id, RequestPhase.FINISHED)

    # ---- steps -----------------------------------------------------------------------
    def _prompt(self, req: ProcessRequest) -> tuple[list[int], tuple[PromptImage, ...]]:
        """The prompt's ids (image placeholders widened) and its images."""
        if not req.messages or not any(m.images for m in req.messages):
            ids = self._prompt_ids(req)
            if self._images is not None and self._images.image_token_id in ids:
                raise InvalidRequest(f"the prompt holds the image token {self._images.image_token!r} but no "
                                     f"image; send images as image_url content parts", param="messages")
            return ids, ()
        if self._images is None:
            raise InvalidRequest(f"the model {self.model_name!r} does not accept images",
                                 param="messages", code="image_input_not_supported")
        ids = self._prompt_ids(req, self._images)
        try:
            full, images = self._images.expand(ids, req.messages)
        except ValueError as e:
            raise InvalidRequest(f"messages: {e} (is the image token {self._images.image_token!r} "
                                 f"written in the text?)", param="messages") from None
        self._check_length(full, "messages")
        return full, images

    def _prompt_ids(self, req: ProcessRequest, images: ImagePrompting | None = None) -> list[int]:
        if req.model and req.model != self.model_name:
            raise ModelNotFound(f"the model {req.model!r} does not exist; this cluster serves "
                                f"{self.model_name!r}", param="model", code="model_not_found")
        given = [x is not None for x in (req.messages, req.prompt, req.prompt_ids)]
        if sum(given) != 1:
            raise InvalidRequest("give exactly one of messages, prompt or prompt token ids")
        if req.messages is not None:
            if not req.messages:
                raise InvalidRequest("messages must not be empty", param="messages")
            for i, m in enumerate(req.messages):
                if m.role not in CHAT_ROLES:
                    raise InvalidRequest(f"messages.{i}.role: {m.role!r} is not one of "
                                         f"{sorted(CHAT_ROLES)}", param=f"messages.{i}.role")
            msgs = [{"role": x.role, "content": images.render_content(x) if images else x.content}
                    for x in req.messages]
            extra: dict = {}
            if req.tools and req.tool_choice.mode != "none":
                if self._tok.template_takes_tools:
                    extra["tools"] = tool_dicts(req.tools)
                else:
                    msgs = with_tool_prompt(msgs, req.tools)
            try:
                ids = self._tok.encode(self._tok.apply_chat_template(msgs, **extra))
            except (ChatTemplateError, ValueError, TypeError) as e:
                # NOTE: TypeError: the tokenizer's answer to text that is not valid Unicode
                # (a lone surrogate), which only an in-process caller can pass.
                raise InvalidRequest(f"cannot apply the chat template: {e}", param="messages") from None
            param = "messages"
        elif req.prompt is not None:
            try:
                ids, param = self._tok.encode(req.prompt), "prompt"
            except (ValueError, TypeError) as e:
                raise InvalidRequest(f"cannot tokenize the prompt: {e}", param="prompt") from None
        else:
            ids, param = list(req.prompt_ids or ()), "prompt"
            bad = [t for t in ids if not 0 <= t < self._tok.vocab_size]
            if bad:
                raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary "
                                     f"[0, {self._tok.vocab_size})", param="prompt")
        if not ids:
            raise InvalidRequest("the prompt is empty", param=param)
        self._check_length(ids, param)
        return ids

    def _check_length(self, ids: list[int], param: str) -> None:
        if len(ids) >= self.context_length:
            raise InvalidRequest(
                f"This model's maximum context length is {self.context_length} tokens, but the "
                f"prompt has {len(ids)} tokens (at least one token must be left to generate)",
                param=param, code="context_length_exceeded")

    def _sampling(self, req: ProcessRequest, prompt_len: int) -> SamplingParams:
        # NOTE: a max_tokens past the context is clamped, not refused: the engine ends the
        # request with finish_reason "length" at the context limit either way. Resolving it
        # here gives migration a number to count down from.
        s = req.sampling
        bad = [t for t in s.stop_token_ids if t >= self._tok.vocab_size]
        if bad:
            raise InvalidRequest(f"stop_token_ids: token id {bad[0]} is outside the vocabulary "
                                 f"[0, {self._tok.vocab_size})", param="stop_token_ids")
        bad = [t for t, _ in s.logit_bias if t >= self._tok.vocab_size]
        if bad:
            raise InvalidRequest(f"logit_bias: token id {bad[0]} is outside the vocabulary "
                                 f"[0, {self._tok.vocab_size})", param="logit_bias")
        room = self.context_length - prompt_len
        return replace(s, max_tokens=room if s.max_tokens is None else min(s.max_tokens, room))

    async def _route(self, request_id: str, ids: list[int],
                     exclude: tuple[str, ...] = (), images: tuple[PromptImage, ...] = ()) -> RouteResponse:
        # The router is shared and processors scale out: hash the prompt here (image blocks
        # with their images' hashes). A prompt under one block has no hashes, so it goes as
        # its (few) token ids.
        hashes = local_block_hashes(ids, self._block_size, images)
        req = RouteRequest(request_id, () if hashes else ids, hashes or None, exclude)
        route = await self._router.route(req)  # raises InvalidRequest or Unavailable
        if not route.address:
            await self.reports.send_now(request_id, RequestPhase.FINISHED)
            raise Unavailable(f"decode worker {route.worker_id} announced no gRPC address")
        return route

    async def _stream(self, request_id: str, ids: list[int], sampling: SamplingParams,
                      stops: StopMatcher, route: RouteResponse,
                      images: tuple[PromptImage, ...] = ()) -> AsyncIterator[Delta]:
        """Stream from ``route``'s worker; when it fails (dies, refuses, ends the stream
        without a finish or aborts), migrate: route ``ids + produced`` again excluding the
        failed workers, with ``max_tokens`` less what was produced and the seeded draws
        continued, up to ``migration_limit`` times. The detokenizer and stop matcher live
        here, so the client's text continues with nothing repeated or lost."""
        limit = sampling.max_tokens
        assert limit is not None  # resolved by _sampling
        detok = IncrementalDetokenizer(self._tok)
        produced: list[int] = []
        tail = ""  # text that goes out with the finish reason
        lps: list[TextLogprob] = []  # logprobs not sent yet: they go with the next delta
        last: TokenOutput | None = None
        failed: list[str] = []  # worker ids that failed this request
        full = 0  # of them, refused because their queue was full
        while True:
            attempt_ids = ids + produced if produced else ids
            attempt_sp = replace(sampling, max_tokens=limit - len(produced),
                                 seed_step_offset=sampling.seed_step_offset + len(produced))
            chunks = (self._workers.generate(route.address, request_id, attempt_ids, attempt_sp, images=images)
                      if images else self._workers.generate(route.address, request_id, attempt_ids, attempt_sp))
            failure: str | None = None
            first = True
            try:
                async for chunk in chunks:
                    if chunk.token_ids:
                        if first:
                            first = False
                            await self.reports.send(request_id, RequestPhase.PREFILLED)
                        produced.extend(chunk.token_ids)
                        self.metrics.completion_tokens.inc(len(chunk.token_ids))
                        if chunk.logprobs:
                            lps.extend(self._text_logprob(x) for x in chunk.logprobs)
                        text = stops.feed(detok.add(chunk.token_ids))
                        if stops.stopped or chunk.finish_reason is not None:
                            tail = text
                        elif text:
                            yield Delta(text, logprobs=tuple(lps))
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
            except Overloaded as e:
                failure, full = e.message, full + 1
            except ServingError as e:
                failure = e.message
            finally:
                await chunks.aclose()  # cancels the worker call when we stopped early
            if failure is None and last is not None and last.finish_reason is FinishReason.ABORT:
                failure, last = "aborted the request", None
            if failure is None:
                break
            if len(produced) >= limit:
                # NOTE: the worker died after its last token but before the finish message.
                last = TokenOutput(request_id, [], True, FinishReason.LENGTH, len(ids))
                break
            try:
                route = await self._migrate(request_id, ids, produced, route, failure, failed, images)
            except Unavailable as e:
                if not produced and full == len(failed):  # every worker tried was full: 429
                    raise Overloaded(e.message, code="overloaded") from None
                raise
        if stops.stopped:
            # NOTE: we cancelled the worker before its final usage: the cached count is the
            # router's view of the prefix this worker held.
            cached = min(route.overlap_blocks * self._block_size, len(ids))
            yield Delta(tail, FinishReason.STOP, Usage(len(ids), len(produced), cached),
                        logprobs=tuple(lps))
            return
        assert last is not None
        tail += stops.feed(detok.flush())
        tail += stops.flush()
        reason = (FinishReason.STOP if stops.stopped or last.finish_reason is FinishReason.STOP
                  else FinishReason.LENGTH)
        cached = last.num_cached_tokens if not failed else min(route.overlap_blocks * self._block_size, len(ids))
        yield Delta(tail, reason, Usage(len(ids), len(produced), cached), logprobs=tuple(lps))

    async def _stream_choices(self, request_id: str, ids: list[int], sampling: SamplingParams,
                              route: RouteResponse, images: tuple[PromptImage, ...] = ()
                              ) -> AsyncIterator[Delta]:
        """``sampling.n`` > 1: one worker stream carries every choice (``index``); each has
        its own detokenizer and stop matcher and ends with its own finish delta; a last
        delta carries the usage (every choice's tokens, up to where each stopped).

        No migration: a worker that fails fails the request (the choices share one
        prefill on that worker; moving them would need every choice's tokens resent)."""
        n = sampling.n
        detoks = [IncrementalDetokenizer(self._tok) for _ in range(n)]
        stops = [StopMatcher(sampling.stop) for _ in range(n)]
        done: list[bool] = [False] * n
        produced = 0
        cached: int | None = None
        first = True
        chunks = self._workers.generate(route.address, request_id, ids, sampling, images)
        try:
            async for chunk in chunks:
                i = chunk.index
                if not 0 <= i < n:
                    raise Unavailable(f"decode worker {route.worker_id} sent choice {i} of {n}")
                if chunk.finish_reason is FinishReason.ABORT:
                    raise Unavailable(f"decode worker {route.worker_id} aborted the request")
                if chunk.finish_reason is not None:
                    cached = chunk.num_cached_tokens
                if done[i]:
                    continue  # stopped by a stop string: the engine's later tokens are dropped
                if chunk.token_ids and first:
                    first = False
                    await self.reports.send(request_id, RequestPhase.PREFILLED)
                produced += len(chunk.token_ids)
                self.metrics.completion_tokens.inc(len(chunk.token_ids))
                lps = tuple(self._text_logprob(x) for x in chunk.logprobs or ())
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
            cached = min(route.overlap_blocks * self._block_size, len(ids))
        yield Delta("", usage=Usage(len(ids), produced, cached))

    def _text_logprob(self, lp: TokenLogprob) -> TextLogprob:
        # NOTE: special tokens are kept (an EOS has a logprob too); a token that is part
        # of a multi-byte character decodes to U+FFFD, as in vLLM.
        dec = self._tok.decode
        return TextLogprob(dec([lp.token_id], skip_special_tokens=False), lp.logprob,
                           tuple((dec([t], skip_special_tokens=False), x) for t, x in lp.top))

    async def _migrate(self, request_id: str, ids: list[int], produced: list[int],
                       route: RouteResponse, failure: str, failed: list[str],
                       images: tuple[PromptImage, ...] = ()) -> RouteResponse:
        """Pick the next worker for a request whose worker failed; Unavailable when the
        migration limit is reached or no other worker is left."""
        failed.append(route.worker_id)
        what = (f"decode worker {route.worker_id} ({route.address}) {failure} after "
                f"{len(produced)} tokens")
        # The failed worker no longer carries this request's load (before the same id is
        # routed again).
        await self.reports.send_now(request_id, RequestPhase.FINISHED)
        if len(failed) > self.migration_limit:
            raise Unavailable(f"{what}; gave up after {self.migration_limit} migrations")
        log.warning("%s; migrating %s (attempt %d of %d)", what, request_id, len(failed),
                    self.migration_limit)
        try:
            new = await self._route(request_id, ids + produced, exclude=tuple(failed), images=images)
        except Unavailable as e:
            raise Unavailable(f"{what}; no other decode worker can continue it: {e}") from None
        self.metrics.migrations.inc()
        return new


def _with_tool_calls(parser: ToolCallParser, d: Delta) -> Delta:
    """``d`` with its text through the tool-call parser; the last one carries the calls."""
    text = parser.feed(d.text)
    if d.finish_reason is None:
        return replace(d, text=text)
    rest, calls = parser.finish()
    return replace(d, text=text + rest, tool_calls=calls)
