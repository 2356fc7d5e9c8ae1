"""No secrets or prompts in the logs: requests (good, streamed, unauthorized, invalid, too long) run
through the whole stack (frontend on uvicorn, processor and router over gRPC, discovery on
a real nats-server, the real decode worker) with every logger captured at DEBUG; neither
the prompt text nor the API key appears in any record."""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
import pytest

from services.common.config import NatsConfig
from services.model.tokenizer import Tokenizer
from tests.support.cluster import running_cluster
from tests.support.mock_cluster import MODEL, mock_cluster_cfg
from tests.support.stack import worker_decode_node

PROMPT = "my-secret-prompt-zebra-quartz"
KEY = "sk-tandem-test-key-8f3e2a"


@pytest.fixture(scope="module")
def tok(smollm2_path: Path) -> Tokenizer:
    return Tokenizer.from_path(smollm2_path)


async def test_prompts_and_api_keys_never_reach_the_logs(
        nats_url: str, tok: Tokenizer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    cfg = mock_cluster_cfg(namespace="loghyg", nats={"url": nats_url}, frontend={"api_keys": [KEY]})
    async with running_cluster(cfg, tok, node_factory=lambda: worker_decode_node(cfg, tok)) as c:
        auth = {"Authorization": f"Bearer {KEY}"}
        msgs = [{"role": "user", "content": PROMPT}]
        async with httpx.AsyncClient(base_url=c.url, timeout=30) as http:
            ok = await http.post("/v1/chat/completions", headers=auth,
                                 json={"model": MODEL, "messages": msgs, "max_tokens": 4})
            assert ok.status_code == 200, ok.text
            stream = await http.post("/v1/completions", headers=auth, json={
                "model": MODEL, "prompt": PROMPT, "max_tokens": 4, "stream": True})
            assert stream.status_code == 200 and "[DONE]" in stream.text
            bad_key = await http.post("/v1/chat/completions",
                                      headers={"Authorization": f"Bearer {KEY}x"},
                                      json={"model": MODEL, "messages": msgs})
            assert bad_key.status_code == 401
            invalid = await http.post("/v1/chat/completions", headers=auth, json={
                "model": MODEL, "messages": msgs, "temperature": 9})
            assert invalid.status_code == 400
            too_long = await http.post("/v1/completions", headers=auth, json={
                "model": MODEL, "prompt": PROMPT * 400, "max_tokens": 4})
            assert too_long.status_code == 400
    records = caplog.records
    assert records, "nothing was logged at all: the capture is not working"
    text = "\n".join(f"{r.name} {r.getMessage()} {r.exc_text or ''}" for r in records)
    assert PROMPT not in text and "zebra" not in text
    assert KEY not in text


def test_config_reprs_hide_secrets() -> None:
    n = NatsConfig(user="u", password="pw-9f8e7d", token="tok-1a2b3c")
    assert "pw-9f8e7d" not in repr(n) and "tok-1a2b3c" not in repr(n)
    cfg = mock_cluster_cfg(frontend={"api_keys": [KEY]})
    assert KEY not in repr(cfg) and KEY not in str(cfg)
