"""Structured output through the whole cluster (`tandem up`, real SmolLM2 on the torch
runner, one decode and one prefill worker): JSON-schema answers over varied schemas all
parse and validate with ``jsonschema``; regex and choice answers match; a named tool call
comes back as a valid ``tool_calls`` entry through the openai client, streamed and not;
pydantic schemas (no ``additionalProperties``) give calls and answers with none of the
keys a small model invents, so ``fn(**args)`` and ``model_validate`` work, also through
langchain-openai's ``bind_tools`` and ``with_structured_output`` and through
instructor (TOOLS and JSON_SCHEMA modes, ``create_partial`` streams), and through the
Responses API (openai's ``responses`` methods, langchain's ``use_responses_api``); a call
cut by max_tokens comes back in ``tool_calls`` with finish_reason "length".
Long prompts are prefilled remotely, so the prefill worker's grammar is exercised too."""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path

import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from pydantic import BaseModel, ConfigDict, Field

from services.common.config import ClusterConfig
from tests.support.mock_cluster import MODEL, mock_cluster_cfg
from tests.support.ports import free_port
from tests.support.procs import needs_nats_server, write_config
from tests.support.tool_models import Search, Weather, get_weather, search
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


class Person(BaseModel):
    model_config = ConfigDict(extra="forbid")  # validation only: its schema is not sent
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)


def _pydantic_tool(name: str, description: str, model: type[BaseModel]) -> dict:
    # What langchain's bind_tools sends: the pydantic schema as is, no additionalProperties.
    schema = model.model_json_schema()
    assert "additionalProperties" not in schema
    return {"type": "function", "function": {"name": name, "description": description,
                                             "parameters": schema}}


def test_pydantic_schemas_call_their_functions_and_validate(url: str) -> None:
    tools = [_pydantic_tool("get_weather", "Get the current weather in a city", Weather),
             _pydantic_tool("search", "Search the web", Search)]
    fns = {"get_weather": get_weather, "search": search}
    asks = ["What is the weather like in Paris?", "Is it cold in Oslo?", "Search news about Mars"]
    person = {k: v for k, v in Person.model_json_schema().items() if k != "additionalProperties"}

    async def call(c: openai.AsyncOpenAI, ask: str, choice: object) -> None:
        r = await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ask}],
                                            tools=tools, tool_choice=choice, temperature=0)
        assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
        (tc,) = r.choices[0].message.tool_calls
        fns[tc.function.name](**json.loads(tc.function.arguments))

    async def answer(c: openai.AsyncOpenAI) -> None:
        r = await c.chat.completions.create(
            model=MODEL, temperature=0, max_tokens=96,
            messages=[{"role": "user", "content": "Describe a person as JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": person}})
        assert r.choices[0].finish_reason == "stop"
        Person.model_validate_json(r.choices[0].message.content)

    async def go() -> None:
        c = _client(url)
        named = [{"type": "function", "function": {"name": n}} for n in fns]
        await asyncio.gather(*(call(c, a, ch) for a in asks for ch in ("required", *named)),
                             answer(c))

    asyncio.run(go())


def test_langchain_bind_tools_and_with_structured_output(url: str) -> None:
    """langchain-openai as its users call it: ``bind_tools`` with pydantic classes (a forced
    call and ``tool_choice="any"``) gives calls whose ``args`` run the function and validate;
    ``with_structured_output`` (json_schema) returns a validated instance."""
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=url, api_key="none", temperature=0, max_retries=0,
                     timeout=300)
    fns = {"Weather": lambda a: get_weather(**a), "Search": lambda a: search(**a)}
    for choice in ("Weather", "any"):
        msg = llm.bind_tools([Weather, Search], tool_choice=choice).invoke("What is the weather like in Paris?")
        (call,) = msg.tool_calls
        assert call["name"] in fns and (choice == "any" or call["name"] == choice), msg
        assert fns[call["name"]](call["args"])
        {"Weather": Weather, "Search": Search}[call["name"]].model_validate(call["args"])
    person = llm.bind(max_tokens=96).with_structured_output(Person, method="json_schema").invoke(
        "Describe a person as JSON.")
    assert isinstance(person, Person) and person.name


def test_responses_api_through_openai_and_langchain(url: str) -> None:
    """POST /v1/responses as its clients use it: the openai client's ``responses.create``
    with a named function (a ``function_call`` item whose arguments validate),
    ``responses.parse`` with a pydantic ``text_format``, ``responses.stream`` (its event
    state machine accepts our events and assembles the same answer, a call's too), and
    langchain-openai with ``use_responses_api=True``."""
    from langchain_openai import ChatOpenAI

    params = WEATHER["function"]["parameters"]
    tool = {"type": "function", **WEATHER["function"]}
    ask = "What is the weather like in Paris?"
    c = openai.OpenAI(base_url=url, api_key="none", timeout=300, max_retries=0)
    r = c.responses.create(model=MODEL, input=ask, tools=[tool], temperature=0,
                           tool_choice={"type": "function", "name": "get_weather"})
    assert r.status == "completed"
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), params)
    with pytest.raises(openai.NotFoundError, match="stores no responses"):
        c.responses.retrieve(r.id)  # nothing is stored
    # the call's answer sent back as items: the same prompt and answer as chat's messages
    follow = c.responses.create(model=MODEL, temperature=0, max_output_tokens=16, input=[
        {"role": "user", "content": ask},
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "20 celsius"}])
    chat = c.chat.completions.create(model=MODEL, temperature=0, max_tokens=16, messages=[
        {"role": "user", "content": ask},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "20 celsius"}])
    assert follow.output_text == chat.choices[0].message.content != ""
    assert follow.usage.input_tokens == chat.usage.prompt_tokens

    parsed = c.responses.parse(model=MODEL, input="Describe a person as JSON.", text_format=Person,
                               max_output_tokens=96, temperature=0)
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, Person)

    for body in ({"input": "Tell me a joke", "max_output_tokens": 24, "temperature": 0},
                 {"input": ask, "tools": [tool], "tool_choice": "required", "temperature": 0}):
        pieces = []
        with c.responses.stream(model=MODEL, **body) as s:
            for ev in s:
                if ev.type in ("response.output_text.delta", "response.function_call_arguments.delta"):
                    pieces.append(ev.delta)
            final = s.get_final_response()
        whole = c.responses.create(model=MODEL, **body)
        assert [o.type for o in final.output] == [o.type for o in whole.output]
        if body.get("tools"):
            (scall,) = final.output
            assert "".join(pieces) == scall.arguments == whole.output[0].arguments
            jsonschema.validate(json.loads(scall.arguments), params)
        else:
            assert "".join(pieces) == final.output_text == whole.output_text != ""
            assert final.usage.output_tokens == whole.usage.output_tokens

    # tool_choice "auto" with the Responses API's default strict tools, after example calls
    # with keys the functions do not take: the model's calls hold to the schemas.
    shots = [{"role": "user", "content": "What is the weather like in Rome?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather",
              "arguments": '{"city": "Rome", "country": "Italy"}'},
             {"role": "user", "content": "Search the web for the news about Jupiter"},
             {"type": "function_call", "call_id": "call_2", "name": "search",
              "arguments": '{"query": "Jupiter news", "lang": "en"}'}]
    pyd = [{"type": "function", "name": "get_weather", "description": "Get the current weather",
            "parameters": Weather.model_json_schema()},
           {"type": "function", "name": "search", "description": "Search the web",
            "parameters": Search.model_json_schema()}]
    classes = {"get_weather": (Weather, get_weather), "search": (Search, search)}
    made = 0
    for q in ("What is the weather like in Paris?", "Is it cold in Oslo?", "Search news about Mars"):
        r = c.responses.create(model=MODEL, input=[*shots, {"role": "user", "content": q}],
                               tools=pyd, temperature=0, max_output_tokens=64)
        assert r.status == "completed", r
        for item in r.output:
            if item.type == "function_call":
                cls, fn = classes[item.name]
                args = json.loads(item.arguments)
                assert set(args) <= set(cls.model_fields), (q, args)
                fn(**cls.model_validate(args).model_dump())
                made += 1
    assert made >= 2  # the examples lead SmolLM2 to call

    llm = ChatOpenAI(model=MODEL, base_url=url, api_key="none", temperature=0, max_retries=0,
                     timeout=300, use_responses_api=True)
    msg = llm.bind_tools([Weather, Search], tool_choice="Weather").invoke(ask)
    (lc_call,) = msg.tool_calls
    assert lc_call["name"] == "Weather" and get_weather(**lc_call["args"])
    person = llm.bind(max_tokens=96).with_structured_output(Person, method="json_schema").invoke(
        "Describe a person as JSON.")
    assert isinstance(person, Person) and person.name


def test_instructor_tools_and_json_schema_modes_and_partial_streams(url: str) -> None:
    """instructor as its users call it: ``from_openai`` over an ``OpenAI`` client with a
    pydantic ``response_model``, in TOOLS mode (a forced call) and JSON_SCHEMA mode
    (``response_format``), each answering a validated instance on its first try
    (``max_retries=0``: no re-ask hides a bad answer). ``create_partial`` in both modes:
    a JSON_SCHEMA stream gives growing partial objects (parsed with jiter's partial mode)
    and, like TOOLS mode's (a call streams as one ``delta.tool_calls`` chunk, docs/api.md),
    ends on one that validates. JSON mode is left out: it asks for ``json_object`` with the
    schema only in a system message, and SmolLM2-135M does not follow a schema it is only
    told about (it answers other keys)."""
    import instructor
    from openai import OpenAI

    client = OpenAI(base_url=url, api_key="none", timeout=300, max_retries=0)
    modes = (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA)
    ask = [{"role": "user", "content": "What is the weather like in Paris?"}]
    for mode in modes:
        weather = instructor.from_openai(client, mode=mode).chat.completions.create(
            model=MODEL, response_model=Weather, messages=ask, temperature=0, max_tokens=64,
            max_retries=0)
        assert isinstance(weather, Weather) and weather.city, (mode, weather)
        assert get_weather(**weather.model_dump())
    describe = [{"role": "user", "content": "Describe a person as JSON."}]
    for mode in modes:
        parts = list(instructor.from_openai(client, mode=mode).chat.completions.create_partial(
            model=MODEL, response_model=Person, messages=describe, temperature=0, max_tokens=96,
            max_retries=0))
        person = Person.model_validate(parts[-1].model_dump())
        assert person.name, (mode, person)
        if mode is instructor.Mode.JSON_SCHEMA:
            names = [p.name for p in parts if p.name]
            assert len(names) > 2 and names[-1] == person.name, names
            assert all(b.startswith(a) for a, b in pairwise(names)), names
            assert any(p.age is None for p in parts if p.name), parts


def test_call_cut_by_max_tokens_comes_back_as_a_call(url: str) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}

    async def go() -> None:
        c = _client(url)
        r = await c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
            tools=[WEATHER], tool_choice=choice, temperature=0, max_tokens=6)
        assert r.choices[0].finish_reason == "length"
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and r.choices[0].message.content is None
        assert r.usage.completion_tokens == 6

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
