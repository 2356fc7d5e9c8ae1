"""Helpers for the HTTP edge tests (tests/unit/frontend/test_frontend_{strict,body,failures,http}.py):
the frontend in front of the processor's real gRPC hop, stub processors, request bodies as
a buggy client writes them, and checks of OpenAI's error shape; and the in-process API on a
real decode worker that the field and Responses API tests call (``worker_api``)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from services.api.outputs import FinishReason
from services.api.processor import Delta, ModelInfo, ProcessRequest
from services.common.address_book import AddressBook, ChannelPool
from services.common.discovery import Registration
from services.frontend.app import create_app
from services.model.tokenizer import Tokenizer
from services.processor.client import ProcessorClient
from services.processor.grpc_server import serve_processor
from services.router.router import Router
from tests.support.mock_cluster import MODEL, mock_cluster_cfg
from tests.support.stack import DecodeNode, make_processor, worker_decode_node

JSON = {"content-type": "application/json"}


@asynccontextmanager
async def grpc_api(tok: Tokenizer, **over: Any) -> AsyncIterator[httpx.AsyncClient]:
    """The frontend -> processor over gRPC (``ProcessorClient``, as deployed: its codec is
    where an out-of-range id or a lone surrogate used to fail) -> router in-process ->
    the real decode worker (gRPC, mock runner)."""
    cfg = mock_cluster_cfg(**over)
    router = Router(cfg)
    pool = ChannelPool()
    async with worker_decode_node(cfg, tok) as node:
        router.worker_joined(Registration("decode", "w0", address=node.address))
        server, port = await serve_processor(make_processor(cfg, tok, router, 128, pool),
                                                  "127.0.0.1", 0)
        app = create_app(cfg, ProcessorClient(AddressBook("processor", f"127.0.0.1:{port}"), pool))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t") as client:
            yield client
        await server.stop(0)
        assert node.engine.stats().num_running == 0
    await pool.close()


class WorkerApi:
    """The app (in-process processor and router) over httpx's ASGI transport, and the real
    decode worker (mock runner, on gRPC) behind it."""

    def __init__(self, http: httpx.AsyncClient, node: DecodeNode) -> None:
        self.http, self.node = http, node

    async def idle(self) -> None:
        """Every request is gone from the worker: no running sequence, no block held."""
        for _ in range(500):
            s = self.node.engine.stats()
            if s.num_running == 0 and s.kv_blocks_used == 0:
                break
            await asyncio.sleep(0.01)
        s = self.node.engine.stats()
        assert (s.num_running, s.kv_blocks_used) == (0, 0)
        await self.node.engine.check_integrity()


@asynccontextmanager
async def worker_api(tok: Tokenizer, context_length: int) -> AsyncIterator[WorkerApi]:
    cfg = mock_cluster_cfg()
    router = Router(cfg)
    pool = ChannelPool()
    async with worker_decode_node(cfg, tok) as node:
        router.worker_joined(Registration("decode", "w0", address=node.address))
        app = create_app(cfg, make_processor(cfg, tok, router, context_length, pool))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t") as client:
            yield WorkerApi(client, node)
    await pool.close()


class Echo:
    """A processor that answers "ok"."""

    async def generate(self, req: ProcessRequest) -> AsyncIterator[Delta]:
        yield Delta("ok", FinishReason.STOP)

    async def list_models(self) -> list[ModelInfo]:
        return [ModelInfo(MODEL, 128)]


class Failing:
    """A processor whose ``generate`` raises ``exc`` after yielding ``before`` deltas."""

    def __init__(self, exc: Exception, before: int = 0) -> None:
        self.exc, self.before = exc, before

    async def generate(self, req: ProcessRequest) -> AsyncIterator[Delta]:
        for _ in range(self.before):
            yield Delta("x")
        raise self.exc

    async def list_models(self) -> list[ModelInfo]:
        raise self.exc


@asynccontextmanager
async def stub_api(processor: Any, **over: Any) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(mock_cluster_cfg(**over), processor)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        yield c


def chat(**kw: Any) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 2, **kw}


def raw(body: Any) -> bytes:
    # NOTE: ensure_ascii (json's default) writes a lone surrogate as the escape "\ud800",
    # as a buggy client would; httpx's json= would fail to encode it.
    return json.dumps(body).encode()


def error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    """The OpenAI error of ``r``, which must have ``status`` (and name ``param``)."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    if param is not None:
        assert err["param"] == param and err["message"].startswith(param + ":"), err
    return err


async def metric(c: httpx.AsyncClient, status: str) -> float:
    """``tandem_frontend_requests_total{status=...}``."""
    for line in (await c.get("/metrics")).text.splitlines():
        if line.startswith(f'tandem_frontend_requests_total{{status="{status}"}}'):
            return float(line.split()[-1])
    return 0.0


def frontend_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [x for x in caplog.records if x.name == "tandem.frontend"]
