"""A streaming OpenAI-API client that timestamps everything, and the runner that sends a
workload on an arrival schedule.

Times are ``time.perf_counter()`` seconds. A "token chunk" is a streamed chunk carrying
non-empty text; servers may pack several tokens into one, which ITL then sees as one gap
(vLLM's benchmark has the same caveat).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import httpx

from services.bench.arrivals import ArrivalSpec, schedule
from services.bench.workloads import BenchRequest, render_text

Endpoint = Literal["completions", "chat"]


@dataclass
class RequestRecord:
    """What happened to one request. ``chunk_times`` includes the first token's."""

    index: int
    prompt_len: int  # tokens the workload meant to send
    send_time: float = 0.0
    first_token_time: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    end_time: float | None = None
    ok: bool = False
    error: str = ""
    prompt_tokens: int | None = None  # from the server's usage
    completion_tokens: int | None = None
    cached_tokens: int | None = None

    @property
    def output_tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else len(self.chunk_times)


def request_body(req: BenchRequest, model: str, endpoint: Endpoint) -> dict:
    """The JSON body: greedy, exactly ``output_len`` tokens (ignore_eos for servers that
    honour it), streamed with usage on the last chunk."""
    body: dict = {"model": model, "max_tokens": req.output_len, "temperature": 0.0,
                  "stream": True, "stream_options": {"include_usage": True},
                  "ignore_eos": True}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": render_text(req.prompt_ids)}]
    else:
        body["prompt"] = list(req.prompt_ids)
    return body


def _chunk_text(obj: dict) -> str:
    choices = obj.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    if "delta" in c:
        return (c["delta"] or {}).get("content") or ""
    return c.get("text") or ""


def _finished(obj: dict) -> bool:
    choices = obj.get("choices") or []
    return bool(choices and choices[0].get("finish_reason"))


async def send(client: httpx.AsyncClient, url: str, body: dict, rec: RequestRecord,
               timeout_s: float) -> None:
    """POST ``body`` to ``url`` streaming, filling ``rec``; never raises for a failed
    request (the error is recorded)."""
    rec.send_time = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, timeout=timeout_s) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")[:200]
                rec.error = f"HTTP {resp.status_code}: {text}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    rec.error = str(obj["error"])[:200]
                    return
                now = time.perf_counter()
                if _chunk_text(obj) or (rec.first_token_time is None and _finished(obj)):
                    # NOTE: a finish chunk without text still carries a token when none
                    # came before (a detokenizer holding back a partial character).
                    if rec.first_token_time is None:
                        rec.first_token_time = now
                    rec.chunk_times.append(now)
                usage = obj.get("usage")
                if usage:
                    rec.prompt_tokens = usage.get("prompt_tokens")
                    rec.completion_tokens = usage.get("completion_tokens")
                    details = usage.get("prompt_tokens_details") or {}
                    rec.cached_tokens = details.get("cached_tokens")
        rec.end_time = time.perf_counter()
        if rec.first_token_time is None:
            rec.error = "no tokens streamed"
        else:
            rec.ok = True
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        rec.error = f"{type(e).__name__}: {e}"[:200]


@dataclass
class RunResult:
    records: list[RequestRecord]
    start_time: float
    end_time: float

    @property
    def duration_s(self) -> float:
        return self.end_time - self.start_time


async def run_workload(base_url: str, model: str, requests: Sequence[BenchRequest],
                       arrivals: ArrivalSpec, max_requests: int | None = None,
                       duration_s: float | None = None, endpoint: Endpoint = "completions",
                       timeout_s: float = 600.0, api_key: str | None = None) -> RunResult:
    """Send ``requests`` (bounded by ``max_requests`` and ``duration_s`` of sending) and
    wait for all of them. A request with ``after`` waits for that request to finish."""
    reqs = list(requests[: max_requests if max_requests is not None else len(requests)])
    times = schedule(arrivals, len(reqs), duration_s, [r.arrival_s for r in reqs])
    if times is not None:
        reqs = reqs[: len(times)]
    url = base_url.rstrip("/") + ("/v1/chat/completions" if endpoint == "chat" else "/v1/completions")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    done = {r.index: asyncio.Event() for r in reqs}
    records = [RequestRecord(r.index, r.prompt_len) for r in reqs]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout_s) as client:
        start = time.perf_counter()

        async def one(i: int, at: float | None) -> None:
            r = reqs[i]
            if at is not None:
                await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            if r.after is not None and r.after in done:
                await done[r.after].wait()
            try:
                await send(client, url, request_body(r, model, endpoint), records[i], timeout_s)
            finally:
                done[r.index].set()

        if times is not None:
            await asyncio.gather(*(one(i, t) for i, t in enumerate(times)))
        else:
            sem = asyncio.Semaphore(arrivals.concurrency)
            stop_at = None if duration_s is None else start + duration_s

            async def gated(i: int) -> None:
                async with sem:
                    if stop_at is not None and time.perf_counter() > stop_at:
                        records[i].error = "skipped"
                        return
                    await one(i, None)

            await asyncio.gather(*(gated(i) for i in range(len(reqs))))
            records = [r for r in records if r.error != "skipped"]
        end = time.perf_counter()
    return RunResult(records, start, end)
