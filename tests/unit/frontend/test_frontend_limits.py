"""Limits at the API over the REAL decode worker (services/decode, mock runner): a
max_tokens above ``frontend.max_tokens_limit`` is a 400 naming it; a worker whose waiting
queue is full refuses (RESOURCE_EXHAUSTED) and the client gets 429 with Retry-After and a
message that names no worker (the detail is logged)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest

from services.common.address_book import ChannelPool
from services.common.discovery import Registration
from services.frontend.app import create_app
from services.model.tokenizer import Tokenizer
from services.router.router import Router
from tests.support.mock_cluster import MODEL, mock_cluster_cfg
from tests.support.stack import make_processor, worker_decode_node


@pytest.fixture(scope="module")
def tok(smollm2_path: Path) -> Tokenizer:
    return Tokenizer.from_path(smollm2_path)


@asynccontextmanager
async def api(tok: Tokenizer, **over) -> AsyncIterator[httpx.AsyncClient]:
    cfg = mock_cluster_cfg(**over)
    router = Router(cfg)
    pool = ChannelPool()
    async with worker_decode_node(cfg, tok) as node:
        router.worker_joined(Registration("decode", "w0", address=node.address))
        app = create_app(cfg, make_processor(cfg, tok, router, 128, pool))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t") as client:
            yield client
        await node.engine.check_integrity()
        assert node.engine.stats().num_running == 0
    await pool.close()


def chat(**kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi!"}], **kw}


async def test_max_tokens_above_the_limit_is_400(tok: Tokenizer) -> None:
    async with api(tok, frontend={"max_tokens_limit": 50}) as http:
        ok = await http.post("/v1/chat/completions", json=chat(max_tokens=50))
        assert ok.status_code == 200, ok.text
        for field in ("max_tokens", "max_completion_tokens"):
            r = await http.post("/v1/chat/completions", json=chat(**{field: 51}))
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == field and "frontend.max_tokens_limit=50" in err["message"]
        r = await http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 51})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


async def test_full_worker_queue_is_429_with_retry_after(
        tok: Tokenizer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="tandem.frontend")
    async with api(tok, decode={"max_waiting_requests": 0}, frontend={"retry_after_s": 3}) as http:
        for stream in (False, True):
            r = await http.post("/v1/chat/completions", json=chat(max_tokens=4, stream=stream))
            assert r.status_code == 429, r.text
            assert r.headers["retry-after"] == "3"
            err = r.json()["error"]
            # the client is told to retry; which worker refused, and why, is the log's
            assert err["code"] == "overloaded"
            assert err["message"] == "the server is overloaded, retry later"
    details = [x.getMessage() for x in caplog.records if x.name == "tandem.frontend"]
    assert len(details) == 1, details  # the second refusal within the interval is not logged
    assert "429 overloaded" in details[0] and "decode.max_waiting_requests=0" in details[0]
