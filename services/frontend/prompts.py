"""Several prompts in one completions request: one processor request per prompt, all
started at once, merged into one delta stream with OpenAI's choice indexes (prompt ``i``'s
choice ``j`` is ``i * n + j``) and one closing delta with the summed usage.

Every prompt's first delta is awaited before any goes out, so a prompt that cannot start
(too long, a token id outside the vocabulary) fails the whole request with its status
before a response begins. Closing the merged stream (the client left, an error) cancels
every prompt's request."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace

from services.api.outputs import Usage
from services.api.processor import Delta, ProcessRequest

_END = object()  # a prompt's stream ended


async def merged(generate: Callable[[ProcessRequest], AsyncIterator[Delta]],
                 requests: Sequence[ProcessRequest], n: int) -> AsyncIterator[Delta]:
    """The deltas of every request of ``requests`` (one per prompt, each with ``n``
    choices), re-indexed, then ``Delta("", usage=the sum)``."""
    queue: asyncio.Queue[tuple[int, Delta | BaseException | object]] = asyncio.Queue()

    async def pump(i: int, req: ProcessRequest) -> None:
        try:
            async with contextlib.aclosing(generate(req)) as deltas:
                async for d in deltas:
                    queue.put_nowait((i, d))
            queue.put_nowait((i, _END))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(requests)]
    usage = [Usage(0, 0, 0)] * len(requests)
    try:
        started: set[int] = set()
        held: list[tuple[int, Delta | object]] = []
        ended = 0
        while ended < len(requests):
            i, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item is _END:
                ended += 1
            if len(started) < len(requests):
                started.add(i)
                held.append((i, item))
                if len(started) < len(requests):
                    continue
                items, held = held, []
            else:
                items = [(i, item)]
            for j, x in items:
                if x is _END:
                    continue
                assert isinstance(x, Delta)
                if x.usage is not None:
                    usage[j] = x.usage
                out = replace(x, index=j * n + x.index, usage=None)
                if out.text or out.logprobs or out.finish_reason is not None or out.tool_calls:
                    yield out
        yield Delta("", usage=Usage(sum(u.prompt_tokens for u in usage),
                                    sum(u.completion_tokens for u in usage),
                                    sum(u.cached_tokens for u in usage)))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
