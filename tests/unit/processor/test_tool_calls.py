"""Tool calling without a model: the parser (auto and forced, streamed in any split, cut by
max_tokens), the forced-call schema, the tools prompt, and the API shapes through the openai
client (the processor answers with calls, whole or cut); a forced call's default token cap;
bad tool choices are 400s before the processor."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator

import httpx
import jsonschema
import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st
from openai.lib.streaming.chat import ChatCompletionStreamState

from services.api.outputs import FinishReason, Usage
from services.api.processor import Delta, ModelInfo, ProcessRequest, Tool, ToolCall, ToolChoice
from services.api.structured import StructuredKind
from services.frontend.app import create_app
from services.processor.tools import (
    FORCED_CALL_MAX_TOKENS,
    OPEN,
    ToolCallParser,
    _without,
    call_schema,
    strict_calls_grammar,
    with_tool_prompt,
)
from tests.support.mock_cluster import MODEL, mock_cluster_cfg

WEATHER = Tool("get_weather", "Weather of a city", json.dumps(
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}))
TIME = Tool("get_time", "", "")
TOOLS_BODY = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                      "parameters": json.loads(WEATHER.parameters)}},
    {"type": "function", "function": {"name": "get_time"}},
]


def split_feed(parser: ToolCallParser, text: str, size: int) -> str:
    out = "".join(parser.feed(text[i:i + size]) for i in range(0, len(text), size))
    return out


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_auto_parser_streams_content_and_holds_back_calls(size: int) -> None:
    text = 'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    p = ToolCallParser([WEATHER, TIME], ToolChoice("auto"))
    streamed = split_feed(p, text, size)
    rest, calls = p.finish()
    assert streamed == "Let me check. " and rest == ""
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]


def test_auto_parser_gives_back_text_that_is_no_call() -> None:
    for text in ("just words, a < sign", '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
                 "<tool_call>not json"):
        p = ToolCallParser([WEATHER], ToolChoice("auto"))
        streamed = split_feed(p, text, 2)
        rest, calls = p.finish()
        assert calls == () and streamed + rest == text


def test_forced_parser_holds_everything_and_parses_one_call() -> None:
    p = ToolCallParser([WEATHER], ToolChoice("function", "get_weather"))
    assert split_feed(p, '{"name":"get_weather","arguments":{"city":"Oslo"}}', 4) == ""
    rest, calls = p.finish()
    assert rest == "" and calls[0].name == "get_weather" and calls[0].id.startswith("call_")
    cut = ToolCallParser([WEATHER], ToolChoice("required"))
    cut.feed('{"name":"get_wea')
    assert cut.finish() == ('{"name":"get_wea', ())


def test_forced_call_cut_by_max_tokens_is_a_call_with_its_arguments_as_written() -> None:
    def cut(text: str, choice: ToolChoice) -> tuple[str, tuple[ToolCall, ...]]:
        p = ToolCallParser([WEATHER, TIME], choice)
        assert split_feed(p, text, 3) == ""
        return p.finish(cut=True)

    required = ToolChoice("required")
    rest, (call,) = cut('{"name":"get_weather","arguments":{"city":"Os', required)
    assert rest == "" and (call.name, call.arguments) == ("get_weather", '{"city":"Os')
    # The name cut: the one function it can still be, no arguments yet.
    rest, (call,) = cut('{"name":"get_w', required)
    assert rest == "" and (call.name, call.arguments) == ("get_weather", "")
    # A named function is the call even before its name was written.
    rest, (call,) = cut("", ToolChoice("function", "get_time"))
    assert (call.name, call.arguments) == ("get_time", "")
    # Two functions it can still be: no call, the text as written.
    assert cut('{"name":"get_', required) == ('{"name":"get_', ())


def test_auto_call_cut_by_max_tokens_follows_whole_calls() -> None:
    text = ('Sure. <tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par')
    p = ToolCallParser([WEATHER, TIME], ToolChoice("auto"))
    assert split_feed(p, text, 5) == "Sure. "
    rest, calls = p.finish(cut=True)
    assert rest == ""
    assert [(c.name, c.arguments) for c in calls] == [("get_time", "{}"),
                                                       ("get_weather", '{"city": "Par')]
    # Not cut: an unfinished call is no call.
    p = ToolCallParser([WEATHER, TIME], ToolChoice("auto"))
    split_feed(p, text, 5)
    assert p.finish() == (text[len("Sure. "):], ())


def test_call_schema_admits_only_the_chosen_calls() -> None:
    named = call_schema([WEATHER, TIME], ToolChoice("function", "get_weather"))
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "x"}}, named)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "get_time", "arguments": {}}, named)
    anyof = call_schema([WEATHER, TIME], ToolChoice("required"))
    jsonschema.validate({"name": "get_time", "arguments": {"tz": 1}}, anyof)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "get_weather", "arguments": {}}, anyof)


@given(st.text(alphabet="<tool_cal>x\n", max_size=40))
def test_the_free_text_pattern_is_every_string_without_the_call_tag(text: str) -> None:
    assert (re.fullmatch(_without(OPEN), text) is not None) == (OPEN not in text)


@pytest.fixture(scope="module")
def ll_tokenizer(smollm2_path):
    import llguidance as llg

    from services.model.tokenizer import Tokenizer

    tok = Tokenizer.from_path(smollm2_path)
    return tok, llg.LLTokenizer(tok.to_json(), n_vocab=tok.vocab_size,
                                eos_token=list(tok.stop_token_ids))


@pytest.mark.parametrize(("text", "ok"), [
    ("No call needed: a < b, and <tool_cal is not a tag.", True),
    ('Sure. <tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>', True),
    ('<tool_call>{"name":"get_time","arguments":{}}</tool_call>\n<tool_call>'
     '{"name":"get_weather","arguments":{"city":"Oslo"}}</tool_call>\n', True),
    ('<tool_call>{"name":"get_weather","arguments":{"city":"Paris","unit":"C"}}', False),  # extra key
    ('<tool_call>{"name":"get_weather","arguments":{}}', False),  # missing city
    ('<tool_call>{"name":"nope"', False),
    ('<tool_call>{"name": "get_weather"', False),  # compact JSON only
    ('<tool_call>{"name":"get_time","arguments":{}}</tool_call> and more text', False),
])
def test_the_strict_calls_grammar_takes_free_text_or_exact_calls(ll_tokenizer, text: str,
                                                                  ok: bool) -> None:
    from llguidance import LLMatcher

    tok, ltok = ll_tokenizer
    m = LLMatcher(ltok, strict_calls_grammar([WEATHER, TIME]))
    assert not m.is_error(), m.get_error()
    took = all(m.consume_token(t) for t in tok.encode(text))
    assert (took and m.is_accepting()) == ok, (text, m.get_error())


def test_without_parallel_calls_the_grammar_takes_one(ll_tokenizer) -> None:
    from llguidance import LLMatcher

    tok, ltok = ll_tokenizer
    one = '<tool_call>{"name":"get_time","arguments":{}}</tool_call>'
    for parallel, text, ok in ((False, one, True), (False, one + "\n" + one, False),
                               (True, one + "\n" + one, True)):
        m = LLMatcher(ltok, strict_calls_grammar([WEATHER, TIME], parallel=parallel))
        took = all(m.consume_token(t) for t in tok.encode(text))
        assert (took and m.is_accepting()) == ok, (parallel, text)


def test_tool_prompt_joins_a_system_message_or_leads() -> None:
    user = [{"role": "user", "content": "hi"}]
    msgs = with_tool_prompt(user, [WEATHER])
    assert msgs[0]["role"] == "system" and "get_weather" in msgs[0]["content"] and msgs[1:] == user
    msgs = with_tool_prompt([{"role": "system", "content": "Be brief."}, *user], [WEATHER])
    assert len(msgs) == 2 and msgs[0]["content"].startswith("Be brief.\n\n# Tools")


class ToolProcessor:
    """Answers every request with one call to get_weather (as the real processor would
    after parsing), streaming some deltas first."""

    def __init__(self) -> None:
        self.requests: list[ProcessRequest] = []
        self.call = ToolCall("call_1", "get_weather", '{"city": "Paris"}')
        self.reason = FinishReason.STOP

    async def generate(self, req: ProcessRequest) -> AsyncIterator[Delta]:
        self.requests.append(req)
        yield Delta("")
        yield Delta("", self.reason, Usage(5, 9), (self.call,))

    async def list_models(self) -> list[ModelInfo]:
        return [ModelInfo(MODEL, 128)]


@pytest.fixture
async def client() -> AsyncIterator[tuple[openai.AsyncOpenAI, ToolProcessor]]:
    proc = ToolProcessor()
    app = create_app(mock_cluster_cfg(), proc)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as h:
        yield openai.AsyncOpenAI(base_url="http://t/v1", api_key="x", http_client=h), proc


MSGS = [{"role": "user", "content": "Weather in Paris?"}]


async def test_named_tool_choice_constrains_and_answers_tool_calls(client) -> None:
    c, proc = client
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = await c.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS_BODY, tool_choice=choice)
    assert r.choices[0].finish_reason == "tool_calls"
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    req = proc.requests[-1]
    assert req.tool_choice == ToolChoice("function", "get_weather") and len(req.tools) == 2
    spec = req.sampling.structured
    assert spec is not None and spec.kind is StructuredKind.JSON_SCHEMA
    assert json.loads(spec.spec)["properties"]["name"] == {"const": "get_weather"}


async def test_streamed_tool_calls_assemble_in_the_openai_client(client) -> None:
    c, _ = client
    state = ChatCompletionStreamState()
    stream = await c.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS_BODY,
                                             tool_choice="required", stream=True)
    async for chunk in stream:
        state.handle_chunk(chunk)
    final = state.get_final_completion()
    assert final.choices[0].finish_reason == "tool_calls"
    call = final.choices[0].message.tool_calls[0]
    assert call.id == "call_1" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


async def test_call_cut_by_max_tokens_is_in_tool_calls_with_finish_reason_length(client) -> None:
    c, proc = client
    proc.call, proc.reason = ToolCall("call_2", "get_weather", '{"city": "Par'), FinishReason.LENGTH
    r = await c.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS_BODY,
                                        tool_choice="required", max_tokens=9)
    assert r.choices[0].finish_reason == "length"
    (call,) = r.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Par')
    state = ChatCompletionStreamState()
    stream = await c.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS_BODY,
                                             tool_choice="required", max_tokens=9, stream=True)
    async for chunk in stream:
        state.handle_chunk(chunk)
    # NOTE: get_final_completion raises LengthFinishReasonError for any "length" answer.
    final = state.current_completion_snapshot
    assert final.choices[0].finish_reason == "length"
    assert final.choices[0].message.tool_calls[0].function.arguments == '{"city": "Par'


async def test_forced_call_without_max_tokens_gets_the_default_cap(client) -> None:
    c, proc = client
    choice = {"type": "function", "function": {"name": "get_weather"}}
    for tc in ("required", choice):
        await c.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS_BODY, tool_choice=tc)
        assert proc.requests[-1].sampling.max_tokens == FORCED_CALL_MAX_TOKENS
    await c.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS_BODY,
                                    tool_choice="required", max_completion_tokens=2000)
    assert proc.requests[-1].sampling.max_tokens == 2000
    await c.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS_BODY)
    assert proc.requests[-1].sampling.max_tokens is None


async def test_auto_sends_tools_without_a_constraint_and_none_sends_no_choice(client) -> None:
    c, proc = client
    await c.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS_BODY)
    assert proc.requests[-1].tool_choice == ToolChoice("auto")
    assert proc.requests[-1].sampling.structured is None
    await c.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS_BODY, tool_choice="none")
    assert proc.requests[-1].tool_choice == ToolChoice("none")


async def test_a_strict_tool_under_auto_puts_the_answer_under_the_calls_grammar(client) -> None:
    c, proc = client
    strict = [{**TOOLS_BODY[0], "function": {**TOOLS_BODY[0]["function"], "strict": True}},
              TOOLS_BODY[1]]
    await c.chat.completions.create(model=MODEL, messages=MSGS, tools=strict)
    sent = proc.requests[-1]
    assert sent.tool_choice == ToolChoice("auto") and sent.sampling.max_tokens is None
    assert sent.sampling.structured is not None
    assert sent.sampling.structured.kind is StructuredKind.GRAMMAR
    assert sent.sampling.structured.spec == strict_calls_grammar(
        [WEATHER, Tool("get_time", "", "")])
    await c.chat.completions.create(model=MODEL, messages=MSGS, tools=strict,
                                    parallel_tool_calls=False)
    assert proc.requests[-1].sampling.structured.spec == strict_calls_grammar(
        [WEATHER, Tool("get_time", "", "")], parallel=False)
    with pytest.raises(openai.BadRequestError, match="cannot be combined with strict tools"):
        await c.chat.completions.create(model=MODEL, messages=MSGS, tools=strict,
                                        response_format={"type": "json_object"})


@pytest.mark.parametrize(("extra", "param", "text"), [
    ({"tools": TOOLS_BODY, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "not in tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS_BODY, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format", "cannot be combined"),
    ({"tools": [TOOLS_BODY[0], TOOLS_BODY[0]]}, "tools", "unique"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}],
      "tool_choice": "required"}, "tools", "does not compile"),
])
async def test_bad_tool_choice_is_400_before_the_processor(client, extra, param, text) -> None:
    c, proc = client
    with pytest.raises(openai.BadRequestError) as e:
        await c.chat.completions.create(model=MODEL, messages=MSGS, **extra)
    err = e.value.body
    assert err["param"] == param and text in err["message"]
    assert proc.requests == []
