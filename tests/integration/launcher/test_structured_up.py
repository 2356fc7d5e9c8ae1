"""Structured output through the whole cluster (`tandem up`, real SmolLM2 on the torch
runner, one decode and one prefill worker): JSON-schema answers over varied schemas all
parse and validate with ``jsonschema``; regex and choice answers match; a named tool call
comes back as a valid ``tool_calls`` entry through the openai client, streamed and not.
Long prompts are prefilled remotely, so the prefill worker's grammar is exercised too."""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from services.common.config import ClusterConfig
from tests.support.mock_cluster import MODEL, mock_cluster_cfg
from tests.support.ports import free_port
from tests.support.procs import needs_nats_server, write_config
from tests.support.up import gone, start_up


def _obj(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": props, "required": required or list(props),
            "additionalProperties": False}


NAME = {"type": "string", "maxLength": 16}
SCHEMAS: list[tuple[str, dict]] = [
    ("a person", _obj({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}})),
    ("a city and whether it is a capital", _obj({"city": NAME, "capital": {"type": "boolean"}})),
    ("a colour", _obj({"colour": {"enum": ["red", "green", "blue"]}})),
    ("a temperature in Celsius", _obj({"celsius": {"type": "number", "minimum": -50, "maximum": 60}})),
    ("three small numbers", _obj({"numbers": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                          "maximum": 9},
                                              "minItems": 3, "maxItems": 3}})),
    ("a book with its author", _obj({"title": NAME, "author": _obj({"first": NAME, "last": NAME})})),
    ("a point", _obj({"x": {"type": "integer", "minimum": -10, "maximum": 10},
                      "y": {"type": "integer", "minimum": -10, "maximum": 10}})),
    ("a pet", _obj({"kind": {"enum": ["cat", "dog", "fish"]}, "name": NAME})),
    ("two tags", _obj({"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                "minItems": 2, "maxItems": 2}})),
    ("a product with an optional price", _obj({"product": NAME, "price": {
        "type": "number", "minimum": 0, "maximum": 100}}, required=["product"])),
    ("an answer", {"type": "object", "properties": {"ok": {"type": "boolean"}},
                   "required": ["ok"], "additionalProperties": False}),
    ("a date", _obj({"year": {"type": "integer", "minimum": 1900, "maximum": 2100},
                     "month": {"type": "integer", "minimum": 1, "maximum": 12}})),
    ("a list of people", _obj({"people": {"type": "array", "maxItems": 2, "items": _obj(
        {"name": NAME, "adult": {"type": "boolean"}})}})),
    ("a status", _obj({"status": {"enum": ["on", "off"]}, "level": {"type": "integer", "minimum": 1,
                                                                    "maximum": 5}})),
]
LONG = "Answer only with JSON and keep it short. " * 8  # prefilled remotely (> 48 tokens)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": _obj({"city": NAME, "unit": {"enum": ["celsius", "fahrenheit"]}})}}


@pytest.fixture(scope="module")
def url(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    needs_nats_server()
    tmp = tmp_path_factory.mktemp("structured")
    cfg: ClusterConfig = mock_cluster_cfg(
        namespace=f"so{uuid.uuid4().hex[:8]}",
        model={"name": MODEL, "path": "auto"},
        engine={"runner": "torch", "device": "cpu", "dtype": "float32", "threads": 1,
                "num_kv_blocks": 256, "max_model_len": 1024, "max_num_seqs": 16},
        nats={"url": f"nats://127.0.0.1:{free_port()}", "embedded": True},
        frontend={"port": free_port()},
        processor={"port": free_port(), "metrics_port": free_port()},
        router={"port": free_port(), "metrics_port": free_port()},
        decode={"replicas": 1, "port": free_port(), "metrics_port": free_port(), "grace_period_s": 1,
                "disagg": {"max_local_prefill_length": 48}},
        prefill={"replicas": 1, "metrics_port": free_port(), "grace_period_s": 1},
        launcher={"metrics_port": None})
    up = start_up(write_config(cfg, tmp / "cluster.yaml"), tmp / "run", ["--ready-timeout", "240"])
    try:
        up.wait_for(r"^tandem is ready in", timeout=260)
        yield f"http://127.0.0.1:{cfg.frontend.port}/v1"
    finally:
        code = up.stop()
    assert code == 0, up.output()
    assert all(gone(pid) for pid in up.pids().values())


def _client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url, api_key="none", timeout=300, max_retries=0)


def test_json_schema_answers_parse_and_validate(url: str) -> None:
    async def one(c: openai.AsyncOpenAI, i: int, what: str, schema: dict) -> None:
        content = (LONG if i % 3 == 0 else "") + f"Give me {what} as JSON."
        r = await c.chat.completions.create(
            model=MODEL, temperature=0, max_tokens=96,
            messages=[{"role": "user", "content": content}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}})
        text = r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop", (what, text)
        jsonschema.validate(json.loads(text), schema)

    async def streamed(c: openai.AsyncOpenAI, what: str, schema: dict) -> None:
        stream = await c.chat.completions.create(
            model=MODEL, temperature=0, max_tokens=96, stream=True,
            messages=[{"role": "user", "content": f"Give me {what} as JSON."}],
            extra_body={"guided_json": schema})
        parts, reasons = [], []
        async for chunk in stream:
            parts.append(chunk.choices[0].delta.content or "")
            reasons.append(chunk.choices[0].finish_reason)
        assert reasons[-1] == "stop" and len(parts) > 3
        jsonschema.validate(json.loads("".join(parts)), schema)

    async def go() -> None:
        c = _client(url)
        await asyncio.gather(*(one(c, i, w, s) for i, (w, s) in enumerate(SCHEMAS)),
                             streamed(c, *SCHEMAS[5]))

    asyncio.run(go())


def test_regex_choice_and_json_object_answers_match(url: str) -> None:
    async def go() -> None:
        c = _client(url)
        regex = r"[A-Z][a-z]{2,8}-[0-9]{2}"
        r1, r2, r3 = await asyncio.gather(
            c.completions.create(model=MODEL, prompt="A product code: ", max_tokens=16, temperature=0,
                                 extra_body={"structured_outputs": {"regex": regex}}),
            c.chat.completions.create(model=MODEL, max_tokens=8, temperature=0,
                                      messages=[{"role": "user", "content": "Is water wet?"}],
                                      extra_body={"guided_choice": ["yes", "no", "it depends"]}),
            c.chat.completions.create(model=MODEL, max_tokens=64, temperature=0,
                                      messages=[{"role": "user", "content": "Describe a cat."}],
                                      response_format={"type": "json_object"}))
        assert re.fullmatch(regex, r1.choices[0].text), r1.choices[0].text
        assert r2.choices[0].message.content in ("yes", "no", "it depends")
        if r3.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(r3.choices[0].message.content), dict)
        else:
            assert r3.choices[0].message.content.startswith("{")

    asyncio.run(go())


def test_named_tool_call_streamed_and_not(url: str) -> None:
    params = WEATHER["function"]["parameters"]
    choice = {"type": "function", "function": {"name": "get_weather"}}
    msgs = [{"role": "user", "content": "What is the weather like in Paris?"}]

    async def go() -> None:
        c = _client(url)
        r = await c.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER],
                                            tool_choice=choice, temperature=0, max_tokens=64)
        assert r.choices[0].finish_reason == "tool_calls"
        (call,) = r.choices[0].message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), params)
        state = ChatCompletionStreamState()
        stream = await c.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER],
                                                 tool_choice=choice, temperature=0, max_tokens=64,
                                                 stream=True)
        async for chunk in stream:
            state.handle_chunk(chunk)
        final = state.get_final_completion()
        assert final.choices[0].finish_reason == "tool_calls"
        (scall,) = final.choices[0].message.tool_calls
        assert scall.function.name == "get_weather"
        assert json.loads(scall.function.arguments) == json.loads(call.function.arguments)
        clock = {"type": "function", "function": {"name": "get_time", "parameters": _obj(
            {"timezone": {"enum": ["UTC", "CET"]}})}}
        r = await c.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER, clock],
                                            tool_choice="required", temperature=0, max_tokens=64)
        (call,) = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls"
        chosen = next(t for t in (WEATHER, clock) if t["function"]["name"] == call.function.name)
        jsonschema.validate(json.loads(call.function.arguments), chosen["function"]["parameters"])

    asyncio.run(go())


def test_uncompilable_schema_is_a_400(url: str) -> None:
    async def go() -> None:
        c = _client(url)
        with pytest.raises(openai.BadRequestError, match="does not compile"):
            await c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "x"}],
                response_format={"type": "json_schema", "json_schema": {
                    "name": "bad", "schema": {"type": "object", "properties": {"a": {"type": "wat"}}}}})

    asyncio.run(go())
