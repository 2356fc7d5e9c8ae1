"""200 concurrent streams against a small cluster (every hop real: uvicorn frontend,
processor and router over gRPC, discovery on a real nats-server, the REAL decode worker over
the mock runner) whose decode worker admits 4 running + 8 waiting requests: every stream
either completes or is refused with 429/503 and a Retry-After; nothing else (no 500)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from services.model.tokenizer import Tokenizer
from tests.support.cluster import running_cluster
from tests.support.mock_cluster import MODEL, mock_cluster_cfg
from tests.support.stack import worker_decode_node


@pytest.fixture(scope="module")
def tok(smollm2_path: Path) -> Tokenizer:
    return Tokenizer.from_path(smollm2_path)


async def test_200_concurrent_streams_complete_or_get_429_with_retry_after(
        nats_url: str, tok: Tokenizer) -> None:
    cfg = mock_cluster_cfg(namespace="overload", nats={"url": nats_url},
                           engine={"max_num_seqs": 4, "mock": {"step_base_s": 0.05}},
                           decode={"max_waiting_requests": 8}, frontend={"retry_after_s": 2})
    async with running_cluster(cfg, tok, node_factory=lambda: worker_decode_node(cfg, tok)) as c:
        limits = httpx.Limits(max_connections=250, max_keepalive_connections=250)
        async with httpx.AsyncClient(base_url=c.url, limits=limits, timeout=60) as http:

            async def one(i: int) -> tuple[int, str | None, int]:
                body = {"model": MODEL, "stream": True, "max_tokens": 6,
                        "messages": [{"role": "user", "content": f"Story number {i}"}]}
                async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                    if r.status_code != 200:
                        await r.aread()
                        assert r.headers.get("retry-after") == "2", (r.status_code, r.text)
                        return r.status_code, None, 0
                    finish, n = None, 0
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            chunk = json.loads(line[6:])
                            assert "error" not in chunk, chunk
                            if chunk["choices"]:
                                finish = chunk["choices"][0]["finish_reason"] or finish
                        n += line == "data: [DONE]"
                    return 200, finish, n

            results = await asyncio.gather(*(one(i) for i in range(200)))
        statuses = [s for s, _, _ in results]
        assert set(statuses) <= {200, 429, 503}, sorted(set(statuses))
        done = [(f, n) for s, f, n in results if s == 200]
        assert all(f == "length" and n == 1 for f, n in done), done[:5]
        # The bound is real: some were refused, and the admitted ones all finished.
        assert statuses.count(429) > 0 and len(done) >= 12
        await c.node.engine.check_integrity()
        assert c.node.engine.stats().num_running == 0 and c.node.worker.num_inflight == 0
