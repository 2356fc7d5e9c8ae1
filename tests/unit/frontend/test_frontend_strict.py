"""Strict request bodies through the processor's real gRPC hop (issue 17): token ids out of
uint32, lone surrogates and coerced numbers or booleans are a 400 in OpenAI's shape naming
the field; they used to be 500s (the codec could not encode them) or silently coerced."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from services.model.tokenizer import Tokenizer
from tests.support.http_edge import JSON, chat, error, grpc_api, raw
from tests.support.mock_cluster import MODEL


@pytest.fixture
def tok(smollm2_tokenizer: Tokenizer) -> Tokenizer:
    return smollm2_tokenizer


@pytest.fixture
async def http(tok: Tokenizer) -> AsyncIterator[httpx.AsyncClient]:
    async with grpc_api(tok) as client:
        yield client


@pytest.mark.parametrize("token", [-1, 2**32, 2**63, 2**64])
async def test_prompt_token_id_out_of_uint32_is_400(http: httpx.AsyncClient, token: int) -> None:
    body = {"model": MODEL, "prompt": [5, token], "max_tokens": 2}
    error(await http.post("/v1/completions", content=raw(body), headers=JSON), 400, "prompt.1")


async def test_prompt_token_id_past_the_vocabulary_is_the_processors_400(
        http: httpx.AsyncClient) -> None:
    r = await http.post("/v1/completions", json={"model": MODEL, "prompt": [49152], "max_tokens": 2})
    assert "outside the vocabulary" in error(r, 400)["message"]


@pytest.mark.parametrize("token", [-1, 2**32, 2**64])
async def test_stop_token_id_out_of_uint32_is_400(http: httpx.AsyncClient, token: int) -> None:
    r = await http.post("/v1/chat/completions", content=raw(chat(stop_token_ids=[token])), headers=JSON)
    error(r, 400, "stop_token_ids.0")


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": "a\ud800"}]),
     "messages.0.content"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": "\udfff"}]}]), "messages.0.content.0.text"),
    ("/v1/chat/completions", chat(stop="\ud800"), "stop"),
    ("/v1/chat/completions", chat(stop=["ok", "\ud800"]), "stop.1"),
    ("/v1/chat/completions", chat(user="\ud800"), "user"),
    ("/v1/completions", {"model": MODEL, "prompt": "x\ud800y"}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ["\ud800"]}, "prompt.0"),
])
async def test_lone_surrogate_is_400_naming_the_field(http: httpx.AsyncClient, path: str,
                                                      body: dict, param: str) -> None:
    err = error(await http.post(path, content=raw(body), headers=JSON), 400, param)
    assert "lone UTF-16 surrogate" in err["message"]


async def test_surrogate_in_the_model_name_is_400(http: httpx.AsyncClient) -> None:
    r = await http.post("/v1/chat/completions", content=raw(chat(model="\ud800")), headers=JSON)
    error(r, 400, "model")


@pytest.mark.parametrize("value", [2**63, 1e30])
async def test_huge_top_k_is_400(http: httpx.AsyncClient, value: float) -> None:
    error(await http.post("/v1/chat/completions", json=chat(top_k=value)), 400, "top_k")


@pytest.mark.parametrize(("field", "value"), [
    ("max_tokens", "8"), ("max_tokens", True), ("max_tokens", 8.0), ("stream", "true"),
    ("stream", 1), ("temperature", "1"), ("temperature", True), ("seed", "1"), ("n", "1"),
    ("ignore_eos", "false"), ("top_k", False), ("stop_token_ids", [True]),
])
async def test_strict_types_no_coercion(http: httpx.AsyncClient, field: str, value: Any) -> None:
    r = await http.post("/v1/chat/completions", json=chat(**{field: value}))
    param = f"{field}.0" if isinstance(value, list) else field
    error(r, 400, param)


async def test_strict_stream_options_and_completion_echo(http: httpx.AsyncClient) -> None:
    r = await http.post("/v1/chat/completions",
                        json=chat(stream=True, stream_options={"include_usage": "yes"}))
    error(r, 400, "stream_options.include_usage")
    r = await http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "echo": 0})
    error(r, 400, "echo")


async def test_integers_are_still_floats(http: httpx.AsyncClient) -> None:
    """OpenAI clients send temperature: 1 and top_p: 1; strict mode must keep them."""
    r = await http.post("/v1/chat/completions", json=chat(temperature=1, top_p=1))
    assert r.status_code == 200, r.text
    r = await http.post("/v1/chat/completions", json=chat(temperature=0, presence_penalty=0))
    assert r.status_code == 200, r.text


