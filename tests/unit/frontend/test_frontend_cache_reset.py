"""POST /reset_prefix_cache at the HTTP edge: the answer per worker, 503 when a worker did not
confirm, the API key, and vLLM's query parameter honoured or refused."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from services.api.wire import CacheResetReply
from services.common.cache_reset import CacheResetResult
from services.common.config import parse_config
from services.frontend.app import create_app


class NoProcessor:
    def generate(self, req):  # pragma: no cover - never reached by these requests
        raise AssertionError("a cache reset reaches no processor")

    async def list_models(self):  # pragma: no cover
        raise AssertionError("a cache reset reaches no processor")


async def client(result: CacheResetResult, calls: list[int], **frontend) -> AsyncIterator[httpx.AsyncClient]:
    async def reset() -> CacheResetResult:
        calls.append(1)
        return result

    app = create_app(parse_config({"frontend": frontend}), NoProcessor(), reset_caches=reset)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        yield c


ALL = CacheResetResult([CacheResetReply("decode-0", "decode", 5, 2),
                        CacheResetReply("prefill-0", "prefill", 7, 0)], [])


async def test_every_worker_confirmed_is_200_with_counts() -> None:
    calls: list[int] = []
    async for c in client(ALL, calls):
        r = await c.post("/reset_prefix_cache")
        assert r.status_code == 200, r.text
        assert r.json() == {"object": "prefix_cache_reset", "evicted_blocks": 12, "workers": [
            {"id": "decode-0", "role": "decode", "evicted_blocks": 5, "blocks_in_use": 2},
            {"id": "prefill-0", "role": "prefill", "evicted_blocks": 7, "blocks_in_use": 0}]}
        r = await c.post("/reset_prefix_cache?reset_running_requests=false")
        assert r.status_code == 200
    assert len(calls) == 2


@pytest.mark.parametrize(("result", "text"), [
    (CacheResetResult([CacheResetReply("decode-0", "decode", 1, 0)], ["decode-1"]),
     "1 of 2 workers did not confirm the reset"),
    (CacheResetResult([], []), "no worker is available"),
])
async def test_a_worker_that_did_not_confirm_is_503_with_retry_after(result: CacheResetResult,
                                                                     text: str) -> None:
    async for c in client(result, [], retry_after_s=3):
        r = await c.post("/reset_prefix_cache")
        assert r.status_code == 503
        assert r.headers["retry-after"] == "3"
        err = r.json()["error"]
        assert text in err["message"] and err["code"] == "no_workers"
        assert "decode-1" not in r.text  # a 503 never names the cluster's insides


@pytest.mark.parametrize(("query", "param"), [
    ("reset_running_requests=true", "reset_running_requests"),  # we never preempt
    ("reset_external=true", "reset_external"),
])
async def test_parameters_we_cannot_honour_are_400_and_reset_nothing(query: str, param: str) -> None:
    calls: list[int] = []
    async for c in client(ALL, calls):
        r = await c.post(f"/reset_prefix_cache?{query}")
        assert r.status_code == 400 and r.json()["error"]["param"] == param
    assert calls == []


async def test_a_body_is_400_and_resets_nothing() -> None:
    calls: list[int] = []
    async for c in client(ALL, calls):
        r = await c.post("/reset_prefix_cache", json={"reset_running_requests": True})
        assert r.status_code == 400 and "takes no body" in r.json()["error"]["message"]
        assert (await c.post("/reset_prefix_cache", content=b"")).status_code == 200
    assert calls == [1]


async def test_the_api_key_guards_it() -> None:
    calls: list[int] = []
    async for c in client(ALL, calls, api_keys=["sekret"]):
        assert (await c.post("/reset_prefix_cache")).status_code == 401
        r = await c.post("/reset_prefix_cache", headers={"Authorization": "Bearer sekret"})
        assert r.status_code == 200
    assert calls == [1]


async def test_without_a_cluster_view_there_is_no_such_route() -> None:
    app = create_app(parse_config({}), NoProcessor())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        r = await c.post("/reset_prefix_cache")
        assert r.status_code == 404 and "error" in r.json()
