"""The streaming client's parsing of OpenAI SSE streams (served by httpx.MockTransport)."""

from __future__ import annotations

import json

import httpx

from services.bench.client import RequestRecord, request_body, send
from services.bench.workloads import BenchRequest


def _sse(*objs: dict) -> bytes:
    return b"".join(f"data: {json.dumps(o)}\n\n".encode() for o in objs) + b"data: [DONE]\n\n"


def _transport(status: int, body: bytes) -> httpx.MockTransport:
    return httpx.MockTransport(lambda req: httpx.Response(status, content=body))


async def test_send_records_chunks_usage_and_cached_tokens() -> None:
    body = _sse({"choices": [{"text": "a", "finish_reason": None}]},
                {"choices": [{"text": "", "finish_reason": None}]},  # no text: not a token chunk
                {"choices": [{"text": "b", "finish_reason": "length"}]},
                {"choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 3,
                                          "prompt_tokens_details": {"cached_tokens": 32}}})
    rec = RequestRecord(0, 40)
    async with httpx.AsyncClient(transport=_transport(200, body)) as c:
        await send(c, "http://x/v1/completions", {}, rec, 5.0)
    assert rec.ok and rec.error == "" and len(rec.chunk_times) == 2
    assert rec.send_time <= rec.first_token_time == rec.chunk_times[0] <= rec.end_time
    assert (rec.prompt_tokens, rec.completion_tokens, rec.cached_tokens, rec.output_tokens) == (40, 3, 32, 3)


async def test_send_chat_deltas_and_a_textless_single_token() -> None:
    body = _sse({"choices": [{"delta": {"role": "assistant"}, "finish_reason": None}]},
                {"choices": [{"delta": {}, "finish_reason": "length"}]})
    rec = RequestRecord(0, 5)
    async with httpx.AsyncClient(transport=_transport(200, body)) as c:
        await send(c, "http://x/v1/chat/completions", {}, rec, 5.0)
    # one token whose text was held back: its finish chunk is the first token
    assert rec.ok and len(rec.chunk_times) == 1


async def test_send_records_http_errors() -> None:
    rec = RequestRecord(0, 5)
    async with httpx.AsyncClient(transport=_transport(503, b'{"error": "no workers"}')) as c:
        await send(c, "http://x/v1/completions", {}, rec, 5.0)
    assert not rec.ok and rec.error.startswith("HTTP 503") and "no workers" in rec.error


def test_request_body_endpoints() -> None:
    r = BenchRequest(0, (1000, 1001), output_len=7)
    b = request_body(r, "m", "completions")
    assert b["prompt"] == [1000, 1001] and b["max_tokens"] == 7 and b["stream"] is True
    assert b["stream_options"] == {"include_usage": True}
    c = request_body(r, "m", "chat")
    assert c["messages"][0]["role"] == "user" and "prompt" not in c
