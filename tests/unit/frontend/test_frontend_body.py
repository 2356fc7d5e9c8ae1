"""The request body's way in (services/frontend/body.py): 415 unless declared as JSON, 400
for bodies that are not UTF-8 RFC 8259 JSON (NaN, nesting 10,000 deep: it used to be a 500),
408 for a body slower than frontend.body_timeout_s, 499 for a client gone mid-body."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

import httpx
import pytest

from services.frontend.app import create_app
from services.frontend.body import MAX_JSON_DEPTH
from services.model.tokenizer import Tokenizer
from tests.support.http_edge import JSON, Echo, chat, error, grpc_api, metric, raw, stub_api
from tests.support.mock_cluster import mock_cluster_cfg


@pytest.fixture
def tok(smollm2_tokenizer: Tokenizer) -> Tokenizer:
    return smollm2_tokenizer


@pytest.fixture
async def http(tok: Tokenizer) -> AsyncIterator[httpx.AsyncClient]:
    async with grpc_api(tok) as client:
        yield client


# ---- Content-Type ---------------------------------------------------------------------
@pytest.mark.parametrize("content_type", [
    None, "", "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
    "application/jsonx", "application/json; charset=latin-1",
])
async def test_body_not_declared_as_json_is_415(http: httpx.AsyncClient,
                                                content_type: str | None) -> None:
    headers = {} if content_type is None else {"content-type": content_type}
    r = await http.post("/v1/chat/completions", content=raw(chat()), headers=headers)
    assert error(r, 415)["code"] == "unsupported_media_type"


@pytest.mark.parametrize("content_type", [
    "application/json", "application/json; charset=utf-8", "Application/JSON; Charset=UTF-8",
    'application/json;charset="utf-8"',
])
async def test_json_content_types_are_accepted(http: httpx.AsyncClient, content_type: str) -> None:
    r = await http.post("/v1/chat/completions", content=raw(chat()),
                        headers={"content-type": content_type})
    assert r.status_code == 200, r.text


async def test_body_that_is_not_utf8_is_400(http: httpx.AsyncClient) -> None:
    # a surrogate encoded as UTF-8 bytes (CESU-style) rather than escaped
    body = raw(chat()).replace(b"Hi!", b"Hi\xed\xa0\x80")
    r = await http.post("/v1/chat/completions", content=body, headers=JSON)
    assert "not UTF-8" in error(r, 400)["message"]


@pytest.mark.parametrize("opener", ["[", '{"a":'])
async def test_json_nested_10000_deep_is_400(http: httpx.AsyncClient, opener: str) -> None:
    closer = "]" if opener == "[" else "}"
    body = opener * 10_000 + "1" + closer * 10_000
    r = await http.post("/v1/chat/completions", content=body.encode(), headers=JSON)
    assert f"deeper than {MAX_JSON_DEPTH} levels" in error(r, 400)["message"]


async def test_depth_limit_is_exact_and_ignores_brackets_in_strings(http: httpx.AsyncClient) -> None:
    def nested(depth: int) -> str:  # the body object is level 1, "extra" adds depth - 1
        inner = "[" * (depth - 1) + "]" * (depth - 1)
        return json.dumps(chat(messages=[{"role": "user", "content": "[[{{\\\"" * 20}]))[:-1] \
            + f', "extra": {inner}}}'

    ok = await http.post("/v1/chat/completions", content=nested(MAX_JSON_DEPTH).encode(), headers=JSON)
    assert ok.status_code == 200, ok.text
    r = await http.post("/v1/chat/completions", content=nested(MAX_JSON_DEPTH + 1).encode(),
                        headers=JSON)
    error(r, 400)


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
async def test_nan_and_infinity_are_not_json(http: httpx.AsyncClient, literal: str) -> None:
    body = raw(chat()).replace(b'"max_tokens": 2', b'"temperature": ' + literal.encode())
    r = await http.post("/v1/chat/completions", content=body, headers=JSON)
    assert f"{literal} is not a JSON value" in error(r, 400)["message"]


async def test_slow_body_gets_408_in_process() -> None:
    async def trickle() -> AsyncIterator[bytes]:
        yield b'{"model": '
        await asyncio.sleep(5)
        yield b'"x"}'

    async with stub_api(Echo(), frontend={"body_timeout_s": 0.2}) as c:
        r = await c.post("/v1/chat/completions", content=trickle(), headers=JSON)
        assert error(r, 408)["code"] == "request_timeout"
        assert await metric(c, "408") == 1.0


async def test_client_gone_mid_body_is_counted_499_not_an_error(
        caplog: pytest.LogCaptureFixture) -> None:
    app = create_app(mock_cluster_cfg(), Echo())
    messages = [{"type": "http.request", "body": b'{"mo', "more_body": True},
                {"type": "http.disconnect"}]
    sent: list[dict] = []

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "raw_path": b"",
             "query_string": b"", "headers": [(b"content-type", b"application/json")],
             "http_version": "1.1", "scheme": "http", "server": ("t", 80), "client": ("c", 1),
             "root_path": "", "asgi": {"version": "3.0"}}
    await app(scope, receive, send)
    assert sent[0]["status"] == 499
    assert not [x for x in caplog.records if x.levelno >= logging.ERROR]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        assert await metric(c, "499") == 1.0 and await metric(c, "500") == 0.0


