"""The HTTP API over httpx's ASGI transport with the in-process processor (real engine,
mock runner, behind the real decode worker on gRPC): shapes, errors, auth, limits."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from services.common.address_book import ChannelPool
from services.common.config import ClusterConfig
from services.common.discovery import Registration
from services.frontend.app import create_app
from services.model.tokenizer import Tokenizer
from services.router.router import Router
from tests.support.mock_cluster import MODEL, mock_cluster_cfg
from tests.support.stack import make_processor, worker_decode_node

CTX = 128


@pytest.fixture(scope="module")
def tok(smollm2_path: Path) -> Tokenizer:
    return Tokenizer.from_path(smollm2_path)


class Cluster:
    def __init__(self, cfg: ClusterConfig, client: httpx.AsyncClient, router: Router, node) -> None:
        self.cfg, self.http, self.router, self.node = cfg, client, router, node


async def _cluster(tok: Tokenizer, workers: bool = True, **over) -> AsyncIterator[Cluster]:
    cfg = mock_cluster_cfg(**over)
    router = Router(cfg)
    pool = ChannelPool()
    async with worker_decode_node(cfg, tok) as node:
        if workers:
            router.worker_joined(Registration("decode", "w0", address=node.address))
        app = create_app(cfg, make_processor(cfg, tok, router, CTX, pool))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t") as client:
            yield Cluster(cfg, client, router, node)
    await pool.close()


@pytest.fixture
async def c(tok: Tokenizer) -> AsyncIterator[Cluster]:
    async for x in _cluster(tok):
        yield x


def chat_body(**kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi!"}], **kw}


def assert_error(r: httpx.Response, status: int, param: str | None = None, text: str = "") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert text in err["message"]
    if param is not None:
        assert err["param"] == param
    return err


async def test_chat_completion_shape_and_usage(c: Cluster) -> None:
    r = await c.http.post("/v1/chat/completions", json=chat_body(max_tokens=5, temperature=0))
    assert r.status_code == 200, r.text
    b = r.json()
    assert b["object"] == "chat.completion" and b["model"] == MODEL
    (choice,) = b["choices"]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    u = b["usage"]
    assert u["completion_tokens"] == 5 and u["total_tokens"] == u["prompt_tokens"] + 5


async def test_max_completion_tokens_wins(c: Cluster) -> None:
    r = await c.http.post("/v1/chat/completions",
                          json=chat_body(max_tokens=9, max_completion_tokens=3))
    assert r.json()["usage"]["completion_tokens"] == 3


async def test_completion_stream_and_usage_chunk(c: Cluster) -> None:
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    r = await c.http.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [line[6:] for line in r.text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    streamed = "".join(ch["choices"][0]["text"] for ch in chunks[:-1])
    r2 = await c.http.post("/v1/completions", json={**body, "stream": False, "stream_options": None})
    assert streamed == r2.json()["choices"][0]["text"]  # same text either way at temperature 0


async def test_models(c: Cluster) -> None:
    r = await c.http.get("/v1/models")
    assert r.json()["data"][0]["id"] == MODEL and r.json()["data"][0]["context_length"] == CTX
    r = await c.http.get(f"/v1/models/{MODEL}")
    assert r.status_code == 200 and r.json() == {**r.json(), "id": MODEL, "object": "model"}
    for other in ("gpt-4o", "org/" + MODEL):  # an id with "/" reaches the route too
        err = assert_error(await c.http.get(f"/v1/models/{other}"), 404)
        assert err["code"] == "model_not_found" and err["param"] == "model"
        assert repr(other) in err["message"] and repr(MODEL) in err["message"]


@pytest.mark.parametrize(("body", "param", "text"), [
    (chat_body(n=17), "n", "less than or equal to 16"),
    (chat_body(n=0), "n", "greater than or equal to 1"),
    (chat_body(n=2, best_of=3), "best_of", "only best_of=1"),
    (chat_body(temperature=3), "temperature", "less than or equal to 2"),
    (chat_body(max_tokens=0), "max_tokens", "greater than or equal to 1"),
    (chat_body(stop=["a", ""]), "stop", "1 to 256 characters"),
    (chat_body(top_k=2**63), "top_k", "must be in [0, 1048576]"),
    (chat_body(stop_token_ids=[1 << 20]), "stop_token_ids", "outside the vocabulary"),
    ({"model": MODEL, "messages": []}, "messages", "at least 1"),
    ({"model": MODEL}, "messages", "Field required"),
    (chat_body(messages=[{"role": "wizard", "content": "x"}]), "messages.0.role", ""),
    (chat_body(logprobs=True, top_logprobs=21), "top_logprobs", "less than or equal to 20"),
    (chat_body(top_logprobs=2), "top_logprobs", "logprobs must be true"),
    (chat_body(presence_penalty=2.5), "presence_penalty", "less than or equal to 2"),
    (chat_body(frequency_penalty=-3), "frequency_penalty", "greater than or equal to -2"),
    (chat_body(repetition_penalty=0), "repetition_penalty", "greater than 0"),
    (chat_body(logit_bias={"5": 101}), "logit_bias", "[-100, 100]"),
    (chat_body(logit_bias={"x": 1}), "logit_bias", "keys must be token ids"),
    (chat_body(logit_bias={str(1 << 20): 1}), "logit_bias", "outside the vocabulary"),
    (chat_body(min_tokens=9, max_tokens=8), "min_tokens", "at most max_tokens (8)"),
    (chat_body(min_tokens=-1), "min_tokens", "greater than or equal to 0"),
])
async def test_bad_fields_are_400_naming_the_field(c: Cluster, body: dict, param: str, text: str) -> None:
    assert_error(await c.http.post("/v1/chat/completions", json=body), 400, param, text)


async def test_stop_token_ids_and_ignore_eos_reach_the_engine(c: Cluster) -> None:
    """vLLM's stop_token_ids crosses every hop: a stop id the model samples ends it there."""
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0}
    free = (await c.http.post("/v1/completions", json=body)).json()
    assert free["usage"]["completion_tokens"] == 8
    runner = c.node.engine.engine.runner  # the mock runner: its next token is a pure function
    first = runner.next_token([5, 6, 7])
    stopped = (await c.http.post("/v1/completions", json={**body, "stop_token_ids": [first]})).json()
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] == 1



async def test_completions_logprobs_above_20_is_400(c: Cluster) -> None:
    body = {"model": MODEL, "prompt": "x", "logprobs": 21}
    assert_error(await c.http.post("/v1/completions", json=body), 400, "logprobs", "less than or equal to 20")


async def test_min_tokens_masks_the_stop_token_until_reached(c: Cluster) -> None:
    """The mock model would sample ``first`` (a stop token id here) at once: min_tokens
    keeps it out of the first 3 tokens; the frontend's field reaches the engine."""
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0}
    first = c.node.engine.engine.runner.next_token([5, 6, 7])
    got = (await c.http.post("/v1/completions",
                             json={**body, "stop_token_ids": [first], "min_tokens": 3})).json()
    assert got["usage"]["completion_tokens"] >= 3, got


async def test_logprobs_shapes_chat_and_completions(c: Cluster) -> None:
    r = (await c.http.post("/v1/chat/completions",
                           json=chat_body(max_tokens=4, logprobs=True, top_logprobs=1))).json()
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    for e in content:
        assert e["logprob"] == 0.0 and e["bytes"] == list(e["token"].encode())
        assert [t["token"] for t in e["top_logprobs"]] == [e["token"]]
    plain = (await c.http.post("/v1/chat/completions", json=chat_body(max_tokens=4))).json()
    assert plain["choices"][0]["logprobs"] is None

    body = {"model": MODEL, "prompt": "hello", "max_tokens": 3, "logprobs": 0}
    lp = (await c.http.post("/v1/completions", json=body)).json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == 3
    assert lp["top_logprobs"] == [{}, {}, {}] and lp["text_offset"][0] == 0


async def test_n_choices_chat_and_completions_streaming_and_not(c: Cluster) -> None:
    r = (await c.http.post("/v1/chat/completions", json=chat_body(max_tokens=5, n=3))).json()
    assert [ch["index"] for ch in r["choices"]] == [0, 1, 2]
    assert all(ch["finish_reason"] == "length" and ch["message"]["content"] for ch in r["choices"])
    assert r["usage"]["completion_tokens"] == 15  # every choice's tokens, the prompt once
    one = (await c.http.post("/v1/chat/completions", json=chat_body(max_tokens=5))).json()
    assert r["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]

    body = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "n": 2, "stream": True,
            "logprobs": 0, "stream_options": {"include_usage": True}}
    async with c.http.stream("POST", "/v1/completions", json=body) as resp:
        events = [json.loads(line[6:]) async for line in resp.aiter_lines()
                  if line.startswith("data: {")]
    text = {0: "", 1: ""}
    finish: dict[int, str] = {}
    tokens = {0: 0, 1: 0}
    for e in events[:-1]:
        (ch,) = e["choices"]
        text[ch["index"]] += ch["text"]
        tokens[ch["index"]] += len((ch["logprobs"] or {}).get("tokens", []))
        if ch["finish_reason"]:
            finish[ch["index"]] = ch["finish_reason"]
    assert finish == {0: "length", 1: "length"} and tokens == {0: 4, 1: 4}
    assert text[0] and text[0] == text[1]  # the mock model is deterministic
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 8


async def test_ignore_eos_runs_past_eos_to_max_tokens(tok: Tokenizer) -> None:
    mock = {"step_base_s": 0.0, "per_prefill_token_s": 0.0, "per_decode_seq_s": 0.0,
            "vocab_size": 49152, "eos_token_id": 2, "eos_probability": 1.0}  # eos every token
    async for c in _cluster(tok, engine={**mock_cluster_cfg().engine.model_dump(), "mock": mock}):
        body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0}
        eos = (await c.http.post("/v1/completions", json=body)).json()
        assert eos["choices"][0]["finish_reason"] == "stop" and eos["usage"]["completion_tokens"] == 1
        kept = (await c.http.post("/v1/completions", json={**body, "ignore_eos": True})).json()
        assert kept["choices"][0]["finish_reason"] == "length"
        assert kept["usage"]["completion_tokens"] == 6


async def test_bad_json_is_400(c: Cluster) -> None:
    r = await c.http.post("/v1/chat/completions", content=b"{not json",
                          headers={"content-type": "application/json"})
    assert_error(r, 400, text="not valid JSON")


async def test_unknown_model_is_404(c: Cluster) -> None:
    r = await c.http.post("/v1/chat/completions", json={**chat_body(), "model": "gpt-9"})
    assert assert_error(r, 404, "model", "gpt-9")["code"] == "model_not_found"


async def test_too_long_prompt_is_400_naming_the_limit(c: Cluster) -> None:
    body = {"model": MODEL, "prompt": "hello " * 300, "stream": True}
    err = assert_error(await c.http.post("/v1/completions", json=body), 400, "prompt",
                       f"maximum context length is {CTX} tokens")
    assert err["code"] == "context_length_exceeded"


async def test_body_size_limit_is_413(tok: Tokenizer) -> None:
    async for c in _cluster(tok, frontend={"max_body_bytes": 200}):
        r = await c.http.post("/v1/chat/completions", json=chat_body(
            messages=[{"role": "user", "content": "x" * 500}]))
        assert_error(r, 413, text="max_body_bytes")


async def test_no_workers_is_503_with_retry_after(tok: Tokenizer) -> None:
    async for c in _cluster(tok, workers=False, frontend={"retry_after_s": 3}):
        r = await c.http.post("/v1/chat/completions", json=chat_body(stream=True))
        # the detail ("no decode workers registered in discovery") goes to the log
        assert assert_error(r, 503)["message"] == "no worker is available, retry later"
        assert r.headers["retry-after"] == "3"


async def test_api_keys(tok: Tokenizer) -> None:
    async for c in _cluster(tok, frontend={"api_keys": ["sekret"]}):
        r = await c.http.get("/v1/models")
        assert assert_error(r, 401)["type"] == "authentication_error"
        r = await c.http.get("/v1/models", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        r = await c.http.get("/v1/models", headers={"Authorization": "Bearer sekret"})
        assert r.status_code == 200
        assert (await c.http.get(f"/v1/models/{MODEL}")).status_code == 401
        assert (await c.http.get("/live")).status_code == 200  # probes need no key


async def test_metrics_count_statuses_and_latencies(c: Cluster) -> None:
    await c.http.post("/v1/chat/completions", json=chat_body(max_tokens=4, stream=True))
    await c.http.post("/v1/chat/completions", json={**chat_body(), "model": "nope"})
    text = (await c.http.get("/metrics")).text
    assert 'tandem_frontend_requests_total{status="200"} 1.0' in text
    assert 'tandem_frontend_requests_total{status="404"} 1.0' in text
    assert "tandem_frontend_time_to_first_token_seconds_count 1.0" in text
    itl = re.search(r"^tandem_frontend_inter_token_latency_seconds_count (\S+)$", text, re.M)
    assert itl is not None and float(itl.group(1)) >= 1
    assert "tandem_frontend_request_duration_seconds_count 2.0" in text


async def test_request_timeout_is_504_and_aborts(tok: Tokenizer) -> None:
    # 500 tokens at >= 10 ms a step cannot finish inside a 0.3 s budget.
    async for c in _cluster(tok, frontend={"request_timeout_s": 0.3},
                            engine={"mock": {"step_base_s": 0.01}}):
        r = await c.http.post("/v1/chat/completions", json=chat_body(max_tokens=500))
        assert assert_error(r, 504, text="request_timeout_s")["type"] == "timeout_error"
        r = await c.http.post("/v1/chat/completions", json=chat_body(max_tokens=500, stream=True))
        events = [e[6:] for e in r.text.split("\n\n") if e.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "timeout"
        for _ in range(500):
            if c.node.engine.stats().num_running == 0 and c.node.engine.stats().kv_blocks_used == 0:
                break
            await asyncio.sleep(0.01)
        assert c.node.engine.stats().kv_blocks_used == 0
