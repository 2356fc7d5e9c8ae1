"""Every OpenAI request field honoured or refused (docs/api.md's table), and the completions
API as evaluation harnesses use it (echo with prompt logprobs, max_tokens 0, several
prompts, token-id prompts), over httpx's ASGI transport with the in-process processor and
the real decode worker on the mock runner (a deterministic model: a prompt token's logprob
is 0 where it is the model's own next token, else -9999)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from services.frontend.schemas import ChatCompletionRequest
from services.model.tokenizer import Tokenizer
from tests.support.http_edge import WorkerApi as Api
from tests.support.http_edge import worker_api
from tests.support.mock_cluster import MODEL

CTX = 512
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def tok(smollm2_path: Path) -> Tokenizer:
    return Tokenizer.from_path(smollm2_path)


@pytest.fixture
async def api(tok: Tokenizer) -> AsyncIterator[Api]:
    async with worker_api(tok, CTX) as a:
        yield a


def chat(**kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 3, **kw}


def completion(**kw) -> dict:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, **kw}


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CALLED = [{"role": "user", "content": "Hi!"},
          {"role": "assistant", "content": None, "tool_calls": [
              {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]


def assert_400(r: httpx.Response, param: str, text: str = "") -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and text in err["message"], err
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize(("body", "param", "text"), [
    (chat(prediction={"type": "content", "content": "x"}), "prediction", "not supported"),
    (chat(modalities=["text", "audio"]), "modalities", 'only ["text"]'),
    (chat(audio={"voice": "alloy", "format": "mp3"}), "audio", "not supported"),
    (chat(web_search_options={}), "web_search_options", "no web search"),
    (chat(functions=[{"name": "f"}]), "functions", "send tools"),
    (chat(function_call="auto"), "function_call", "send tool_choice"),
    (chat(moderation={"model": "m"}), "moderation", "not supported"),
    (chat(reasoning_effort="low"), "reasoning_effort", "not a reasoning model"),
    (chat(verbosity="high"), "verbosity", "not supported"),
    (chat(store=True), "store", "not stored"),
    (chat(service_tier="flex"), "service_tier", "one tier"),
    (chat(min_p=1.5), "min_p", "less than or equal to 1"),
    (chat(messages=[*CALLED, {"role": "tool", "tool_call_id": "call_9", "content": "1"}]),
     "messages.2.tool_call_id", "'call_9' names no tool call"),
    (chat(messages=[*CALLED, {"role": "tool", "content": "1"}]),
     "messages.2.tool_call_id", "must name the call"),
    (chat(messages=[{"role": "tool", "tool_call_id": "call_1", "content": "1"}, *CALLED]),
     "messages.0.tool_call_id", "names no tool call of an earlier"),
    (chat(messages=[{"role": "assistant", "content": "x", "audio": {"id": "a"}}]),
     "messages.0.audio", "no audio"),
])
async def test_a_field_we_cannot_honour_is_a_400_naming_it(api: Api, body: dict, param: str,
                                                           text: str) -> None:
    assert_400(await api.http.post("/v1/chat/completions", json=body), param, text)


@pytest.mark.parametrize(("body", "param", "text"), [
    (completion(suffix="end"), "suffix", "no fill-in-the-middle"),
    (completion(max_tokens=0), "max_tokens", "needs echo"),
    (completion(prompt=[[1, 2], []]), "prompt", "must not be empty"),
    (completion(prompt=["a"] * 65, n=4), "prompt", "at most 256 prompts times n"),
    (completion(prompt=[1, "a"]), "prompt", "one kind"),
    (completion(prompt=[[1], "a"]), "prompt", "one kind"),
    (completion(prompt=[1, -1]), "prompt.1", "greater than or equal to 0"),
    (completion(prompt=["a", "b"], echo=True, logprobs=21), "logprobs", "less than or equal to 20"),
])
async def test_a_bad_completions_field_is_a_400_naming_it(api: Api, body: dict, param: str,
                                                          text: str) -> None:
    assert_400(await api.http.post("/v1/completions", json=body), param, text)


async def test_no_op_values_and_ignored_by_spec_fields_are_answered(api: Api) -> None:
    body = chat(modalities=["text"], store=False, service_tier="auto", verbosity="medium",
                metadata={"k": "v"}, user="u", safety_identifier="s", prompt_cache_key="k",
                prompt_cache_retention="24h", parallel_tool_calls=True, min_p=0.1,
                stream=True, stream_options={"include_usage": True, "include_obfuscation": False})
    r = await api.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    answered = [*CALLED, {"role": "tool", "tool_call_id": "call_1", "content": "42"}]
    r = await api.http.post("/v1/chat/completions", json=chat(messages=answered, tools=[TOOL]))
    assert r.status_code == 200, r.text


def test_min_p_and_parallel_tool_calls_reach_the_processor_request() -> None:
    body = ChatCompletionRequest.model_validate(chat(min_p=0.25, tools=[TOOL],
                                                     parallel_tool_calls=False))
    req = body.to_process("r")
    assert req.sampling.min_p == 0.25 and not req.parallel_tool_calls
    assert ChatCompletionRequest.model_validate(chat()).to_process("r").parallel_tool_calls
    # a forced call follows the schema exactly (its grammar): strict is honoured there
    strict = {**TOOL, "function": {**TOOL["function"], "strict": True}}
    for choice in ("required", {"type": "function", "function": {"name": "f"}}, "none"):
        ChatCompletionRequest.model_validate(chat(tools=[strict], tool_choice=choice))


async def test_echo_with_logprobs_returns_the_prompt_tokens_first_with_a_null_first(
        api: Api, tok: Tokenizer) -> None:
    ids = tok.encode(PROMPT)
    r = await api.http.post("/v1/completions", json=completion(echo=True, logprobs=1))
    assert r.status_code == 200, r.text
    (ch,) = r.json()["choices"]
    plain = (await api.http.post("/v1/completions", json=completion())).json()["choices"][0]
    assert ch["text"] == PROMPT + plain["text"]
    lp = ch["logprobs"]
    n = len(ids) + 3
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n
    assert lp["tokens"][: len(ids)] == [tok.decode([t], skip_special_tokens=False) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    # the mock model: 0 where the prompt token is its own next token, else -9999
    assert all(x in (0.0, -9999.0) for x in lp["token_logprobs"][1:])
    assert all(len(t) == 1 for t in lp["top_logprobs"][1:])
    assert lp["text_offset"][: 2] == [0, len(lp["tokens"][0])]
    assert r.json()["usage"]["completion_tokens"] == 3
    await api.idle()


async def test_max_tokens_zero_with_echo_is_the_prompt_alone(api: Api, tok: Tokenizer) -> None:
    r = await api.http.post("/v1/completions", json=completion(echo=True, logprobs=0, max_tokens=0))
    assert r.status_code == 200, r.text
    (ch,) = r.json()["choices"]
    assert ch["text"] == PROMPT and ch["finish_reason"] == "length"
    assert len(ch["logprobs"]["tokens"]) == len(tok.encode(PROMPT))
    assert ch["logprobs"]["top_logprobs"][1:] == [{}] * (len(tok.encode(PROMPT)) - 1)
    u = r.json()["usage"]
    assert u["completion_tokens"] == 0 and u["prompt_tokens"] == len(tok.encode(PROMPT))
    # n choices: each echoes the prompt with its logprobs (computed once, by choice 0)
    r = await api.http.post("/v1/completions",
                            json=completion(echo=True, logprobs=0, max_tokens=0, n=3))
    assert r.status_code == 200, r.text
    chs = r.json()["choices"]
    assert [c["index"] for c in chs] == [0, 1, 2] and all(c["text"] == PROMPT for c in chs)
    assert all(c["logprobs"] == ch["logprobs"] for c in chs)
    await api.idle()


async def test_several_prompts_give_a_choice_per_prompt_and_n_indexed_as_openai(
        api: Api, tok: Tokenizer) -> None:
    prompts = ["Hello", "The cat sat on", PROMPT]
    single = []
    for p in prompts:
        single.append((await api.http.post("/v1/completions", json=completion(prompt=p))).json())
    r = await api.http.post("/v1/completions", json=completion(prompt=prompts, n=2))
    assert r.status_code == 200, r.text
    b = r.json()
    assert [c["index"] for c in b["choices"]] == list(range(6))
    for i, s in enumerate(single):
        for j in range(2):  # the mock model is deterministic: every choice is the same text
            assert b["choices"][i * 2 + j]["text"] == s["choices"][0]["text"]
    assert b["usage"]["prompt_tokens"] == sum(s["usage"]["prompt_tokens"] for s in single)
    assert b["usage"]["completion_tokens"] == 6 * 3

    body = completion(prompt=prompts, n=2, stream=True, stream_options={"include_usage": True})
    async with api.http.stream("POST", "/v1/completions", json=body) as resp:
        events = [json.loads(x[6:]) async for x in resp.aiter_lines() if x.startswith("data: {")]
    text = [""] * 6
    finished = set()
    for e in events[:-1]:
        (ch,) = e["choices"]
        text[ch["index"]] += ch["text"]
        if ch["finish_reason"]:
            finished.add(ch["index"])
    assert text == [c["text"] for c in b["choices"]] and finished == set(range(6))
    assert events[-1]["choices"] == [] and events[-1]["usage"] == b["usage"]
    await api.idle()


async def stream_events(api: Api, path: str, body: dict) -> list[dict]:
    async with api.http.stream("POST", path, json=body) as resp:
        assert resp.status_code == 200
        return [json.loads(x[6:]) async for x in resp.aiter_lines() if x.startswith("data: {")]


def assert_running_usage(events: list[dict], prompt_tokens: list[int], n: int,
                         final: dict) -> None:
    """Every chunk but the last carries its choice's usage so far (vLLM's
    continuous_usage_stats): its prompt's tokens, and completion tokens that never go down
    and end at the choice's own count; the last chunk is the request's usage."""
    counts: dict[int, list[int]] = {}
    for e in events[:-1]:
        (ch,) = e["choices"]
        u = e["usage"]
        assert u["prompt_tokens"] == prompt_tokens[ch["index"] // n], e
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
        counts.setdefault(ch["index"], []).append(u["completion_tokens"])
    assert sorted(counts) == list(range(len(prompt_tokens) * n))
    for c in counts.values():
        assert c == sorted(c) and c[-1] > 0
    assert sum(c[-1] for c in counts.values()) == final["completion_tokens"]
    assert events[-1]["choices"] == []
    # NOTE: not the cached count: a repeat finds its prompt in the prefix cache.
    last = {k: v for k, v in events[-1]["usage"].items() if k != "prompt_tokens_details"}
    assert last == {k: v for k, v in final.items() if k != "prompt_tokens_details"}


async def test_continuous_usage_stats_puts_the_running_usage_in_every_chunk(
        api: Api, tok: Tokenizer) -> None:
    usage = {"include_usage": True, "continuous_usage_stats": True}
    whole = (await api.http.post("/v1/chat/completions", json=chat(n=2, max_tokens=4))).json()
    events = await stream_events(api, "/v1/chat/completions",
                                 chat(n=2, max_tokens=4, stream=True, stream_options=usage))
    prompt = whole["usage"]["prompt_tokens"]
    # The role chunks come before any token: each choice's count starts at 0.
    roles = [e for e in events if e["choices"] and "role" in e["choices"][0]["delta"]]
    assert [e["usage"]["completion_tokens"] for e in roles] == [0, 0]
    assert_running_usage(events, [prompt], 2, whole["usage"])
    assert whole["usage"]["completion_tokens"] == 8

    # Several prompts: each chunk counts its own prompt's tokens.
    prompts = ["Hello", "The cat sat on", PROMPT]
    body = completion(prompt=prompts, n=2, stream=True, stream_options=usage)
    events = await stream_events(api, "/v1/completions", body)
    lengths = [len(tok.encode(p)) for p in prompts]
    assert_running_usage(events, lengths, 2, {**events[-1]["usage"]})
    assert events[-1]["usage"]["prompt_tokens"] == sum(lengths)
    assert events[-1]["usage"]["completion_tokens"] == 6 * 3

    # A stop string holds text back: the count includes the held tokens.
    whole = (await api.http.post("/v1/completions", json=completion(max_tokens=8))).json()
    text = whole["choices"][0]["text"]
    stop = text[len(text) // 2:][:3]
    events = await stream_events(api, "/v1/completions",
                                 completion(max_tokens=8, stop=stop, stream=True,
                                            stream_options=usage))
    final = events[-1]["usage"]
    assert 0 < final["completion_tokens"] < 8
    assert events[-2]["usage"]["completion_tokens"] == final["completion_tokens"]
    await api.idle()


@pytest.mark.parametrize(("options", "has_usage"), [
    ({"include_usage": True}, "null"),
    ({"continuous_usage_stats": True}, "absent"),  # vLLM: counts only with include_usage
    ({"include_usage": False, "continuous_usage_stats": True}, "absent"),
])
async def test_running_usage_needs_include_usage(api: Api, options: dict, has_usage: str) -> None:
    events = await stream_events(api, "/v1/chat/completions",
                                 chat(stream=True, stream_options=options))
    chunks = [e for e in events if e["choices"]]
    if has_usage == "null":
        assert all(e["usage"] is None for e in chunks)
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3
    else:
        assert not any("usage" in e for e in events)
    await api.idle()


async def test_token_id_prompts_answer_as_their_text(api: Api, tok: Tokenizer) -> None:
    a, b = tok.encode("Hello"), tok.encode(PROMPT)
    by_text = (await api.http.post("/v1/completions", json=completion(prompt=["Hello", PROMPT],
                                                                       echo=True))).json()
    by_ids = (await api.http.post("/v1/completions", json=completion(prompt=[a, b],
                                                                      echo=True))).json()
    assert [c["text"] for c in by_ids["choices"]] == [c["text"] for c in by_text["choices"]]
    flat = (await api.http.post("/v1/completions", json=completion(prompt=b))).json()
    assert flat["choices"][0]["text"] == by_text["choices"][1]["text"].removeprefix(PROMPT)
    await api.idle()


@pytest.mark.parametrize("stream", [False, True])
async def test_one_bad_prompt_of_several_fails_the_request_before_it_starts(
        api: Api, tok: Tokenizer, stream: bool) -> None:
    body = completion(prompt=[tok.encode("Hello"), [1 << 20]], stream=stream, max_tokens=50)
    assert_400(await api.http.post("/v1/completions", json=body), "prompt", "outside the vocabulary")
    await api.idle()
