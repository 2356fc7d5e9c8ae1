"""The app on real uvicorn (services/frontend/http_server.py) over a socket: slow or
oversized headers, a body shorter than its Content-Length, idle and half-read connections
all end within their deadlines; nothing logs a traceback."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from services.common.config import ClusterConfig
from services.frontend.app import create_app
from services.frontend.http_server import Server, http_config
from tests.support.http_edge import Echo, Failing, chat, error, frontend_lines, raw
from tests.support.mock_cluster import mock_cluster_cfg
from tests.support.ports import free_port


@asynccontextmanager
async def served(cfg: ClusterConfig, processor: Any = None) -> AsyncIterator[int]:
    port = free_port()
    server = Server(http_config(create_app(cfg, processor or Echo()), cfg.frontend, port))
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    try:
        yield port
    finally:
        server.should_exit = True
        await task


async def exchange(port: int, data: bytes, wait_s: float = 5.0) -> tuple[bytes, float]:
    """Send ``data``, then read until the server closes; the answer and how long it took."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    writer.write(data)
    await writer.drain()
    try:
        async with asyncio.timeout(wait_s):
            answer = await reader.read()  # until EOF: the server closed the connection
    finally:
        writer.close()
    return answer, loop.time() - t0


def timeouts(**kw: float) -> ClusterConfig:
    return mock_cluster_cfg(frontend={"header_timeout_s": 0.3, "body_timeout_s": 0.3,
                                      "keep_alive_timeout_s": 0.3, **kw})


async def test_slow_headers_get_408_and_the_connection_closed() -> None:
    async with served(timeouts()) as port:
        answer, took = await exchange(port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\n")
        assert answer.startswith(b"HTTP/1.1 408 ") and took < 3, (answer, took)
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
        answer, took = await exchange(port, b"")  # connect and say nothing
        assert answer.startswith(b"HTTP/1.1 408 ") and took < 3


async def test_oversized_headers_get_431() -> None:
    head = b"GET /live HTTP/1.1\r\nHost: t\r\n" + (b"X-Pad: " + b"a" * 1000 + b"\r\n") * 100
    async with served(timeouts(header_timeout_s=5)) as port:
        answer, took = await exchange(port, head)  # 100 KB, and the headers never end
        assert answer.startswith(b"HTTP/1.1 431 ") and took < 3, (answer[:200], took)
        ok, _ = await exchange(port, b"GET /live HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        assert ok.startswith(b"HTTP/1.1 200 ")


async def test_bytes_that_are_not_http_get_an_openai_shaped_400() -> None:
    async with served(timeouts(header_timeout_s=5)) as port:
        answer, _ = await exchange(port, b"\x16\x03\x01 hello\r\n\r\n")  # e.g. TLS to a plain port
    assert answer.startswith(b"HTTP/1.1 400 ")
    assert "error" in json.loads(answer.split(b"\r\n\r\n", 1)[1])


async def test_short_body_gets_408_from_the_body_deadline() -> None:
    body = raw(chat())
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body) + 10}\r\n\r\n").encode()
    async with served(timeouts(header_timeout_s=5)) as port:
        answer, took = await exchange(port, head + body)
    assert answer.startswith(b"HTTP/1.1 408 ") and took < 3, (answer, took)
    assert b"connection: close" in answer.lower()
    err = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
    assert err["code"] == "request_timeout" and "frontend.body_timeout_s" in err["message"]


async def test_keep_alive_idle_connection_is_closed_and_a_good_request_passes() -> None:
    body = raw(chat())
    request = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    async with served(timeouts(header_timeout_s=5)) as port:
        answer, took = await exchange(port, request)
    assert answer.startswith(b"HTTP/1.1 200 ") and b'"content":"ok"' in answer
    assert took < 3  # closed after keep_alive_timeout_s of idleness


async def test_body_arriving_after_the_answer_does_not_hold_the_connection() -> None:
    """uvicorn alone never closes this one: the late body cancels its keep-alive timer."""
    async with served(timeouts(header_timeout_s=5)) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /live HTTP/1.1\r\nHost: t\r\nContent-Length: 10\r\n\r\n")
        assert (await reader.readuntil(b'{"status":"alive"}')).startswith(b"HTTP/1.1 200 ")
        await asyncio.sleep(0.1)
        writer.write(b"x" * 10)  # the body nobody reads, after the answer
        async with asyncio.timeout(3):
            assert await reader.read() == b""  # closed by the server
        writer.close()


async def test_unexpected_exception_over_uvicorn_logs_no_traceback(
        caplog: pytest.LogCaptureFixture) -> None:
    async with served(timeouts(header_timeout_s=5), Failing(ValueError("bad"))) as port:
        # NOTE: after uvicorn configured its loggers (which do not propagate to caplog's)
        uvicorn_log = logging.getLogger("uvicorn")
        uvicorn_log.addHandler(caplog.handler)
        try:
            async with httpx.AsyncClient() as client:
                r = await client.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=chat())
        finally:
            uvicorn_log.removeHandler(caplog.handler)
    error(r, 500)
    assert len(frontend_lines(caplog)) == 1
    assert not [x for x in caplog.records if x.exc_info or x.name.startswith("uvicorn")]
