"""POST /v1/responses: each request answers as the chat request it amounts to, in the
Responses API's shape (whole and streamed), and a field it cannot honour is a 400 naming
the Responses field. Over httpx's ASGI transport with the in-process processor and a real
decode worker on the mock runner (deterministic: the same prompt gives the same text)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from services.frontend.responses import ResponsesRequest
from services.model.tokenizer import Tokenizer
from tests.support.http_edge import WorkerApi, worker_api
from tests.support.mock_cluster import MODEL

CTX = 512


@pytest.fixture(scope="module")
def tok(smollm2_path: Path) -> Tokenizer:
    return Tokenizer.from_path(smollm2_path)


class Api(WorkerApi):
    async def respond(self, **body: object) -> dict:
        r = await self.http.post("/v1/responses", json={"model": MODEL, **body})
        assert r.status_code == 200, r.text
        return r.json()

    async def chat(self, **body: object) -> dict:
        r = await self.http.post("/v1/chat/completions", json={"model": MODEL, **body})
        assert r.status_code == 200, r.text
        return r.json()

    async def events(self, **body: object) -> list[tuple[str, dict]]:
        """The stream's (event name, data) pairs."""
        out: list[tuple[str, dict]] = []
        name = ""
        async with self.http.stream("POST", "/v1/responses",
                                    json={"model": MODEL, "stream": True, **body}) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("event: "):
                    name = line[7:]
                elif line.startswith("data: "):
                    out.append((name, json.loads(line[6:])))
        return out


@pytest.fixture
async def api(tok: Tokenizer) -> AsyncIterator[Api]:
    async with worker_api(tok, CTX) as a:
        yield Api(a.http, a.node)


def output_text(resp: dict) -> str:
    return "".join(p["text"] for item in resp["output"] if item["type"] == "message"
                   for p in item["content"])


async def test_a_response_is_its_chat_completion_in_the_responses_shape(api: Api) -> None:
    chat = await api.chat(messages=[{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "Hi!"}],
                          max_completion_tokens=5, temperature=0)
    resp = await api.respond(instructions="Be brief.", input="Hi!", max_output_tokens=5,
                             temperature=0, metadata={"k": "v"})
    assert resp["object"] == "response" and resp["id"].startswith("resp_")
    assert output_text(resp) == chat["choices"][0]["message"]["content"]
    # cut by the limit: incomplete, as OpenAI reports it
    assert resp["status"] == "incomplete"
    assert resp["incomplete_details"] == {"reason": "max_output_tokens"}
    (item,) = resp["output"]
    assert item["type"] == "message" and item["role"] == "assistant"
    assert item["status"] == "incomplete" and item["content"][0]["type"] == "output_text"
    u = resp["usage"]
    assert u["input_tokens"] == chat["usage"]["prompt_tokens"]
    assert u["output_tokens"] == 5 and u["total_tokens"] == u["input_tokens"] + 5
    assert resp["instructions"] == "Be brief." and resp["max_output_tokens"] == 5
    assert resp["temperature"] == 0 and resp["metadata"] == {"k": "v"} and resp["store"] is False
    await api.idle()


async def test_message_items_and_function_calls_are_the_chat_messages(api: Api) -> None:
    call = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{\"x\": 1}"}
    items = [{"role": "developer", "content": "Use tools."},
             {"type": "message", "role": "user",
              "content": [{"type": "input_text", "text": "Hi "}, {"type": "input_text", "text": "there"}]},
             call, {**call, "call_id": "call_2"},
             {"type": "function_call_output", "call_id": "call_1", "output": "42"},
             {"type": "function_call_output", "call_id": "call_2",
              "output": [{"type": "input_text", "text": "43"}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Both done."}]},
             {"role": "user", "content": "Thanks"}]
    calls = [{"id": c, "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}
             for c in ("call_1", "call_2")]
    messages = [{"role": "developer", "content": "Use tools."},
                {"role": "user", "content": "Hi there"},
                {"role": "assistant", "content": None, "tool_calls": calls},  # one turn
                {"role": "tool", "tool_call_id": "call_1", "content": "42"},
                {"role": "tool", "tool_call_id": "call_2", "content": "43"},
                {"role": "assistant", "content": "Both done."},
                {"role": "user", "content": "Thanks"}]
    chat = await api.chat(messages=messages, max_tokens=6, temperature=0)
    resp = await api.respond(input=items, max_output_tokens=6, temperature=0)
    assert output_text(resp) == chat["choices"][0]["message"]["content"]
    assert resp["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
    await api.idle()


async def test_the_stream_is_the_responses_event_sequence(api: Api) -> None:
    whole = await api.respond(input="Hi!", max_output_tokens=6, temperature=0)
    events = await api.events(input="Hi!", max_output_tokens=6, temperature=0,
                              include=["message.output_text.logprobs"], top_logprobs=2)
    names = [n for n, _ in events]
    assert [d["type"] for _, d in events] == names  # the event line names the data's type
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    deltas = [d for n, d in events if n == "response.output_text.delta"]
    assert names[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert names[4:4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
    assert names[4 + len(deltas):] == ["response.output_text.done", "response.content_part.done",
                                       "response.output_item.done", "response.completed"]
    text = "".join(d["delta"] for d in deltas)
    assert text == output_text(whole)
    done = dict(events)["response.output_text.done"]
    assert done["text"] == text
    final = events[-1][1]["response"]  # cut by the limit: completed events, incomplete status
    assert final["status"] == "incomplete" and output_text(final) == text
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["usage"]["output_tokens"] == 6
    assert events[0][1]["response"]["status"] == "in_progress"
    # logprobs asked: one per token, as chat completions gives them (the mock model's
    # alternatives beyond its one token are -inf: none listed), with the tokens' bytes
    lps = [x for d in deltas for x in d["logprobs"]]
    chat = await api.chat(messages=[{"role": "user", "content": "Hi!"}], max_tokens=6,
                          temperature=0, logprobs=True, top_logprobs=2)
    assert lps == chat["choices"][0]["logprobs"]["content"] and len(lps) == 6
    assert all(x["top_logprobs"] for x in lps)
    assert b"".join(bytes(x["bytes"]) for x in lps).decode() == text
    assert done["logprobs"] == lps
    await api.idle()


async def test_without_logprobs_asked_none_come(api: Api) -> None:
    resp = await api.respond(input="Hi!", max_output_tokens=2)
    assert resp["output"][0]["content"][0]["logprobs"] == []
    events = await api.events(input="Hi!", max_output_tokens=2)
    assert all(d["logprobs"] == [] for n, d in events if n == "response.output_text.delta")
    await api.idle()


PNG = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk"
       "+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg==")
CALL = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}
TOOL = {"type": "function", "name": "f", "parameters": {"type": "object"}}


@pytest.mark.parametrize(("body", "param", "text"), [
    ({"input": [{"type": "function_call_output", "call_id": "call_9", "output": "1"}]},
     "input.0.call_id", "names no tool call"),
    ({"input": [CALL, {"type": "function_call_output", "call_id": "call_9", "output": "1"}]},
     "input.1.call_id", "names no tool call"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input.0.type", "'reasoning' items"),
    ({"input": [{"content": "x"}]}, "input.0.type", "None items"),
    ({"input": []}, "input", "must not be empty"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 3}]}]},
     "input.0.content.0.text", "valid string"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input.0.content.0", ""),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
     "input.0.content.0.file_id", "no file store"),
    ({"input": "x", "store": True}, "store", "not stored"),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id", "not stored"),
    ({"input": "x", "conversation": "conv_1"}, "conversation", "not stored"),
    ({"input": "x", "background": True}, "background", "answered in the request"),
    ({"input": "x", "truncation": "auto"}, "truncation", '"disabled"'),
    ({"input": "x", "reasoning": {"effort": "low"}}, "reasoning", "not a reasoning model"),
    ({"input": "x", "include": ["reasoning.encrypted_content"]}, "include.0", "only"),
    ({"input": "x", "top_logprobs": 2}, "top_logprobs", "come with include"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type", ""),
    ({"input": "x", "tools": [TOOL], "tool_choice": {"type": "function", "name": "g"}},
     "tool_choice", "not in tools"),
    ({"input": "x", "max_output_tokens": 10**9}, "max_output_tokens", "more than this server allows"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "s",
                                        "schema": {"type": "nope"}}}}, "text.format", ""),
    ({"input": "x", "tools": [TOOL], "text": {"format": {"type": "json_object"}}},
     "text.format", "cannot be combined with strict tools"),  # strict: the spec's default
    ({"input": "x", "text": {"verbosity": "low"}}, "text.verbosity", '"medium"'),
    ({"input": "x", "service_tier": "flex"}, "service_tier", "one tier"),
    ({"input": "x" * 3000}, "input", "maximum context length"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": PNG}]}]},
     "input", "does not accept images"),  # a text-only model, as chat answers it
])
async def test_a_field_we_cannot_honour_is_a_400_naming_it(api: Api, body: dict, param: str,
                                                           text: str) -> None:
    r = await api.http.post("/v1/responses", json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and text in err["message"], err
    assert err["type"] == "invalid_request_error"
    await api.idle()


async def test_an_unknown_model_is_a_404(api: Api) -> None:
    r = await api.http.post("/v1/responses", json={"model": "gpt-4o", "input": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_an_input_image_is_the_chat_image_part() -> None:
    """The image reaches chat's image path (fetched and checked there, for a model that
    takes images) with its place among the text parts and its detail."""
    body = ResponsesRequest.model_validate({"model": MODEL, "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "What is "},
        {"type": "input_image", "image_url": PNG, "detail": "low"},
        {"type": "input_text", "text": "this?"}]}]})
    chat, where = body.to_chat()
    assert chat.image_urls() == [(0, 1, PNG)] and where == ["input.0"]
    assert chat.messages[0].content[1].image_url.detail == "low"
    assert [getattr(p, "text", None) for p in chat.messages[0].content] == ["What is ", None, "this?"]


async def test_a_stored_response_is_never_found(api: Api) -> None:
    """retrieve, delete, cancel and input items: a 404 saying nothing is stored."""
    for method, path in (("GET", "/v1/responses/resp_1"), ("DELETE", "/v1/responses/resp_1"),
                         ("POST", "/v1/responses/resp_1/cancel"),
                         ("GET", "/v1/responses/resp_1/input_items")):
        r = await api.http.request(method, path)
        assert r.status_code == 404, (method, path, r.text)
        err = r.json()["error"]
        assert err["code"] == "not_found" and "stores no responses" in err["message"]
        assert "'resp_1'" in err["message"]


def test_a_function_tool_is_strict_unless_it_says_not() -> None:
    """The Responses API's default (chat's is not strict): under "auto" a strict tool puts
    the answer under the calls grammar."""
    def structured(**tool: object) -> object:
        body = ResponsesRequest.model_validate({"model": MODEL, "input": "x",
                                                "tools": [{**TOOL, **tool}]})
        chat, _ = body.to_chat()
        return chat.to_process("r").sampling.structured

    assert structured() is not None and structured(strict=True) == structured()
    assert structured(strict=False) is None
