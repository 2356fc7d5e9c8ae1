"""How a request's deltas become a response: the first delta (with the timeout), a whole
answer, or an SSE stream; and cancelling the work when the client goes away."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Iterator
from contextlib import aclosing
from typing import Protocol, TypeVar

from fastapi import Request

from services.api.outputs import FinishReason, Usage
from services.api.processor import Delta
from services.common.errors import ServingError
from services.frontend.errors import APIError, ServingErrors, internal_error
from services.frontend.metrics import FrontendMetrics
from services.frontend.render import Choice, Renderer, StreamUsage

T = TypeVar("T")
log = logging.getLogger("tandem.frontend")


class ClientGone(Exception):
    """The client disconnected before the response started."""


async def unless_disconnected(request: Request, aw: Awaitable[T]) -> T:
    """Await ``aw`` in a task; cancel it if the client disconnects first (raises ClientGone).

    Before a response starts nobody else listens for the disconnect (StreamingResponse does
    once streaming), so a client that gives up on a non-streaming request would otherwise
    leave it generating on the worker until the end.
    """
    task = asyncio.ensure_future(aw)
    watcher = asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ClientGone()
    finally:
        watcher.cancel()
        if not task.done():  # we were cancelled ourselves
            task.cancel()


async def disconnected(request: Request) -> None:
    # NOTE: called after the body was read, so the only message left is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def first_delta(deltas: AsyncIterator[Delta], timeout_s: float) -> Delta:
    # NOTE: asyncio.timeout, not wait_for: wait_for runs the await in a new task.
    try:
        async with asyncio.timeout(timeout_s):
            return await deltas.__anext__()
    except TimeoutError:
        await deltas.aclose()
        raise timeout_error(timeout_s) from None
    except StopAsyncIteration:
        raise ServingError("the processor ended the stream without an answer") from None
    except BaseException:
        await deltas.aclose()
        raise


async def collect(m: FrontendMetrics, deltas: AsyncIterator[Delta], first: Delta, t0: float,
                  timeout_s: float, n: int = 1) -> tuple[list[Choice], Usage | None]:
    choices = [Choice() for _ in range(n)]
    parts: list[list[str]] = [[] for _ in range(n)]
    last = first
    observe_first(m, t0)

    def take(d: Delta) -> None:
        if not 0 <= d.index < n:
            raise ServingError(f"the processor sent choice {d.index} of {n}")
        parts[d.index].append(d.text)
        choices[d.index].logprobs.extend(d.logprobs)
        if d.finish_reason is not None:
            choices[d.index].finish_reason = d.finish_reason
        if d.tool_calls:
            choices[d.index].tool_calls = d.tool_calls

    async def drain() -> None:
        nonlocal last
        async for d in deltas:
            take(d)
            last = d
            if d.ends_request(n):
                break

    take(first)
    try:
        async with aclosing(deltas):
            if not first.ends_request(n):
                async with asyncio.timeout(max(timeout_s - (time.perf_counter() - t0), 0.001)):
                    await drain()
    except TimeoutError:
        raise timeout_error(timeout_s) from None
    for c, p in zip(choices, parts, strict=True):
        c.text = "".join(p)
        c.finish_reason = c.finish_reason or FinishReason.STOP
    return choices, last.usage


def observe_first(m: FrontendMetrics, t0: float) -> None:
    m.ttft.observe(time.perf_counter() - t0)


def timeout_error(timeout_s: float) -> APIError:
    return APIError(504, f"the request took longer than frontend.request_timeout_s ({timeout_s} s)",
                    "timeout_error", code="timeout")


class StreamEvents(Protocol):
    """One API's stream: the events around and for each delta, in its wire format."""

    def opening(self, first: Delta) -> Iterator[str]: ...
    def delta(self, d: Delta, last: bool) -> Iterator[str]: ...  # last: d ends the request
    def failed(self, err: APIError) -> Iterator[str]: ...
    def closing(self) -> Iterator[str]: ...  # after the last event, an error's too


class ChatEvents:
    """Chat and text completions: OpenAI's chunks, ``data: [DONE]`` at the end."""

    def __init__(self, r: Renderer, n: int = 1) -> None:
        self._r = r
        self._n = n

    def opening(self, first: Delta) -> Iterator[str]:
        if self._r.chat:
            for i in range(self._n):
                yield event(self._r.chunk_role(Usage(first.prompt_tokens, 0), i))

    def delta(self, d: Delta, last: bool) -> Iterator[str]:
        r = self._r
        running = Usage(d.prompt_tokens, d.tokens)
        if d.text or d.logprobs:
            yield event(r.chunk_text(d.text, running, d.logprobs, d.index))
        if d.tool_calls:
            yield event(r.chunk_tool_calls(d.tool_calls, running, d.index))
        if d.finish_reason is not None:
            yield event(r.chunk_finish(d.finish_reason, running, d.index, bool(d.tool_calls)))
        if last and r.usage is not StreamUsage.NONE and d.usage is not None:
            yield event(r.chunk_usage(d.usage))

    def failed(self, err: APIError) -> Iterator[str]:
        yield event(err.body())

    def closing(self) -> Iterator[str]:
        yield "data: [DONE]\n\n"


async def sse(m: FrontendMetrics, events: StreamEvents, deltas: AsyncIterator[Delta],
              first: Delta, t0: float, timeout_s: float, errors: ServingErrors,
              request_id: str, n: int = 1) -> AsyncIterator[str]:
    """The stream's events. An error once it started is the API's error events (the
    status line is gone by then), then its closing."""
    status = "499"  # unless we reach the end: the client went away
    observe_first(m, t0)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + max(timeout_s - (time.perf_counter() - t0), 0.001)
    prev = time.perf_counter()
    try:
        async with aclosing(deltas):
            for e in events.opening(first):
                yield e
            d: Delta | None = first
            while d is not None:
                last = d.ends_request(n)
                for e in events.delta(d, last):
                    yield e
                if last:
                    break
                # NOTE: the timeout wraps only the await, never a yield: a yield suspends
                # this generator inside the response's send, where a cancel must not land.
                try:
                    async with asyncio.timeout_at(deadline):
                        d = await deltas.__anext__()
                except StopAsyncIteration:
                    d = None
                now = time.perf_counter()
                m.itl.observe(now - prev)
                prev = now
            if d is None:
                raise ServingError("the processor ended the stream without a finish reason")
            status = "200"
    except ServingError as e:
        err = errors.from_serving_error(e, request_id)
        status = str(err.status)
        for x in events.failed(err):
            yield x
    except TimeoutError:
        status = "504"
        for x in events.failed(timeout_error(timeout_s)):
            yield x
    except Exception as e:  # noqa: BLE001 - a bug below us ends this stream, not the server
        log.error("request %s: stream failed: %s: %s", request_id, type(e).__name__, e)
        status = "500"
        for x in events.failed(internal_error(request_id)):
            yield x
    finally:
        m.requests.labels(status).inc()
        m.duration.observe(time.perf_counter() - t0)
    for x in events.closing():
        yield x


def event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"
