"""OpenAI's Responses API request (``POST /v1/responses``), stateless, as a chat request.

A Responses request is a chat request in other words: ``instructions`` is a system
message, ``input`` the messages (a string: one user message), a ``function_call`` item
an assistant's earlier call and a ``function_call_output`` item the tool's answer,
``text.format`` the response format, ``max_output_tokens`` the token limit. So the body is
checked here for what is its own (item kinds, the fields nothing here can honour), turned
into a ``ChatCompletionRequest`` and checked again as one; an error found there names the
Responses field it came from (``input.2.call_id``, not ``messages.2.tool_call_id``).

Nothing is stored: ``store: true``, ``previous_response_id``, ``conversation`` and
``background`` are refused (a client that wants the conversation continued sends it
whole, as with chat completions). One answer per request (the API has no ``n``).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, ValidationError, field_validator, model_validator

from services.api.sampling import MAX_TOP_LOGPROBS
from services.frontend.errors import APIError
from services.frontend.schemas import (
    Bool,
    ChatCompletionRequest,
    Float,
    Int,
    RequestBody,
    Text,
    refused,
)
from services.frontend.validation import validation_error

VLLM_EXTRAS = ("seed", "stop", "top_k", "min_p", "min_tokens", "ignore_eos", "stop_token_ids",
               "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias")
# The one ``include`` value we can honour.
LOGPROBS_INCLUDE = "message.output_text.logprobs"


class InputText(RequestBody):
    type: Literal["input_text"]
    text: Text


class OutputText(RequestBody):
    """An assistant's earlier answer sent back (its annotations and logprobs unused)."""

    type: Literal["output_text"]
    text: Text


class InputImage(RequestBody):
    type: Literal["input_image"]
    image_url: Text | None = None
    detail: Literal["auto", "low", "high"] = "auto"
    file_id: Text | None = None  # refused: no file store


InputPart = Annotated[InputText | OutputText | InputImage, Field(discriminator="type")]


class MessageItem(RequestBody):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | list[InputPart]


class FunctionCallItem(RequestBody):
    type: Literal["function_call"]
    call_id: Text = Field(min_length=1)
    name: Text
    arguments: Text


class FunctionCallOutputItem(RequestBody):
    type: Literal["function_call_output"]
    call_id: Text = Field(min_length=1)
    output: Text | list[InputText]

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


def _item_kind(v: Any) -> str | None:
    if isinstance(v, dict):
        return v.get("type", "message" if "role" in v else None)
    return getattr(v, "type", None)


# NOTE: the tags are no field's name, so an error's path (validation.py) leaves them out.
_TAGS = {"message": "message_item", "function_call": "call_item",
         "function_call_output": "call_output_item"}
ITEM_KINDS = tuple(_TAGS)
InputItem = Annotated[
    Annotated[MessageItem, Tag("message_item")]
    | Annotated[FunctionCallItem, Tag("call_item")]
    | Annotated[FunctionCallOutputItem, Tag("call_output_item")],
    Discriminator(lambda v: _TAGS.get(_item_kind(v) or ""))]


class FunctionTool(RequestBody):
    type: Literal["function"]
    name: Text = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: Bool | None = None


class NamedFunction(RequestBody):
    type: Literal["function"]
    name: Text


class TextFormat(RequestBody):
    type: Literal["text", "json_object", "json_schema"]
    name: Text | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: Text | None = None
    strict: Bool | None = None


class TextConfig(RequestBody):
    format: TextFormat | None = None
    verbosity: Text | None = None


class StreamOptions(RequestBody):
    include_obfuscation: Bool | None = None  # ignored: our events carry no padding field
    # Chat's option, which aiperf sends here too: response.completed always has the usage.
    include_usage: Bool | None = None


class Reasoning(RequestBody):
    effort: Text | None = None
    summary: Text | None = None
    generate_summary: Text | None = None


class ResponsesRequest(RequestBody):
    model: Text = Field(min_length=1)
    input: Text | list[InputItem]
    instructions: Text | None = None
    max_output_tokens: Int | None = Field(None, ge=1)
    temperature: Float | None = Field(None, ge=0, le=2)
    top_p: Float | None = Field(None, gt=0, le=1)
    top_logprobs: Int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    include: list[Text] | None = None
    stream: Bool = False
    stream_options: StreamOptions | None = None
    tools: list[FunctionTool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: Bool | None = None
    text: TextConfig | None = None
    truncation: Literal["disabled", "auto"] | None = None
    reasoning: Reasoning | None = None
    service_tier: Text | None = None
    # vLLM's sampling extras, as chat completions takes them (guidellm sends ignore_eos and
    # stop): passed on and checked there.
    seed: Any = None
    stop: Any = None
    top_k: Any = None
    min_p: Any = None
    min_tokens: Any = None
    ignore_eos: Any = None
    stop_token_ids: Any = None
    repetition_penalty: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None
    # Ignored by spec: kept with a stored response (we store none) and the caller's ids
    # for abuse tracking and cache routing.
    metadata: dict[str, Text] | None = None
    user: Text | None = None
    safety_identifier: Text | None = None
    prompt_cache_key: Text | None = None
    prompt_cache_retention: Text | None = None
    # Refused unless absent (or their no-op value): nothing here can honour them.
    store: Bool | None = None
    previous_response_id: Text | None = None
    conversation: Any = None
    background: Bool | None = None
    prompt: Any = None
    max_tool_calls: Int | None = None
    context_management: Any = None

    @field_validator("input", mode="before")
    @classmethod
    def _item_kinds(cls, v: Any) -> Any:
        # NOTE: else pydantic's "Unable to extract tag" for an item kind we do not take.
        if isinstance(v, list):
            if not v:
                raise ValueError("input: must not be empty")
            for i, item in enumerate(v):
                kind = _item_kind(item)
                if kind not in ITEM_KINDS:
                    raise ValueError(f"input.{i}.type: {kind!r} items are not supported; "
                                     f"this server takes {', '.join(ITEM_KINDS)} items")
        return v

    @model_validator(mode="after")
    def _check_refused(self) -> ResponsesRequest:
        if self.store:
            raise refused("store", "responses are not stored: send the whole conversation")
        why = {"previous_response_id": "responses are not stored: send the whole conversation",
               "conversation": "conversations are not stored: send the whole conversation",
               "prompt": "no stored prompt templates",
               "max_tool_calls": "no built-in tools; the model's calls all come back",
               "context_management": "no context compaction"}
        for name, reason in why.items():
            if getattr(self, name) is not None:
                raise refused(name, reason)
        if self.background:
            raise refused("background", "responses are answered in the request")
        if self.truncation == "auto":
            raise refused("truncation", 'a prompt longer than the context is an error; only '
                           '"disabled"')
        if self.reasoning is not None and (self.reasoning.effort or self.reasoning.summary
                                           or self.reasoning.generate_summary):
            raise refused("reasoning", "not a reasoning model")
        if self.service_tier not in (None, "auto", "default"):
            raise refused("service_tier", 'one tier: "auto" or "default"')
        if self.text is not None and self.text.verbosity not in (None, "medium"):
            raise refused("text.verbosity", "the model's answer length is its own; only "
                           '"medium"')
        for i, inc in enumerate(self.include or ()):
            if inc != LOGPROBS_INCLUDE:
                raise refused(f"include.{i}", f"only {LOGPROBS_INCLUDE!r}")
        if self.top_logprobs and not self.logprobs:
            raise ValueError(f"top_logprobs: the logprobs come with include "
                             f"[{LOGPROBS_INCLUDE!r}]; without it they would be dropped")
        if not isinstance(self.input, str):
            for i, item in enumerate(self.input):
                if isinstance(item, MessageItem) and not isinstance(item.content, str):
                    for j, p in enumerate(item.content):
                        if isinstance(p, InputImage) and p.file_id is not None:
                            raise refused(f"input.{i}.content.{j}.file_id",
                                           "no file store: send image_url")
                        if isinstance(p, InputImage) and p.image_url is None:
                            raise ValueError(f"input.{i}.content.{j}.image_url: required")
        return self

    @property
    def logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ())

    def to_chat(self) -> tuple[ChatCompletionRequest, list[str]]:
        """The same request as chat completions, and for each of its messages the field of
        this body it came from (``as_responses_error``); an APIError naming this body's
        field."""
        messages, where = self._messages()
        body: dict[str, Any] = {"model": self.model, "messages": messages}
        for name in ("temperature", "top_p", "parallel_tool_calls", "user", "safety_identifier",
                     "prompt_cache_key", "metadata", *VLLM_EXTRAS):
            if (v := getattr(self, name)) is not None:
                body[name] = v
        if self.max_output_tokens is not None:
            body["max_completion_tokens"] = self.max_output_tokens
        if self.logprobs:
            body["logprobs"] = True
            body["top_logprobs"] = self.top_logprobs or 0
        if self.tools is not None:
            # NOTE: a Responses function tool is strict unless it says otherwise (the spec's
            # default, unlike chat's).
            body["tools"] = [{"type": "function", "function": {
                **t.model_dump(exclude={"type"}, exclude_none=True),
                "strict": t.strict is not False}} for t in self.tools]
        tc = self.tool_choice
        if tc is not None:
            body["tool_choice"] = tc if isinstance(tc, str) else {
                "type": "function", "function": {"name": tc.name}}
        fmt = self.text.format if self.text is not None else None
        if fmt is not None:
            if fmt.type == "json_schema":
                spec = {k: v for k, v in (("name", fmt.name), ("schema", fmt.schema_),
                                          ("description", fmt.description),
                                          ("strict", fmt.strict)) if v is not None}
                body["response_format"] = {"type": "json_schema", "json_schema": spec}
            else:
                body["response_format"] = {"type": fmt.type}
        if self.stream:
            body["stream"] = True
        try:
            return ChatCompletionRequest.model_validate(body), where
        except ValidationError as e:
            raise as_responses_error(validation_error(e), where) from None

    def _messages(self) -> tuple[list[dict[str, Any]], list[str]]:
        """The chat messages, and for each the field of this body it came from."""
        out: list[dict[str, Any]] = []
        where: list[str] = []
        if self.instructions is not None:
            out.append({"role": "system", "content": self.instructions})
            where.append("instructions")
        if isinstance(self.input, str):
            out.append({"role": "user", "content": self.input})
            where.append("input")
            return out, where
        for i, item in enumerate(self.input):
            if isinstance(item, MessageItem):
                out.append({"role": item.role, "content": _content(item.content)})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                prev = out[-1] if out else None
                # NOTE: consecutive calls are one assistant turn's, as the model made them.
                if prev is not None and prev["role"] == "assistant" and prev.get("tool_calls"):
                    prev["tool_calls"].append(call)
                    continue
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            else:
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
            where.append(f"input.{i}")
        return out, where


def _content(content: str | list[InputText | OutputText | InputImage]) -> str | list[dict]:
    if isinstance(content, str):
        return content
    return [{"type": "image_url", "image_url": {"url": p.image_url, "detail": p.detail}}
            if isinstance(p, InputImage) else {"type": "text", "text": p.text} for p in content]


# A chat field's name -> the Responses field it came from (the first matching prefix).
_FIELDS = (("max_completion_tokens", "max_output_tokens"),
           ("response_format.json_schema.", "text.format."),
           ("response_format", "text.format"),
           ("tool_choice.function.name", "tool_choice.name"),
           ("top_logprobs", "top_logprobs"))
_MESSAGE = re.compile(r"\bmessages\.(\d+)")
_TOOL = re.compile(r"\btools\.(\d+)\.function\b")


def as_responses_param(param: str, where: list[str]) -> str:
    """A chat request's field path as the Responses body's."""
    def message(m: re.Match[str]) -> str:
        i = int(m.group(1))
        return where[i] if i < len(where) else "input"

    param = _MESSAGE.sub(message, param)
    param = _TOOL.sub(lambda m: f"tools.{m.group(1)}", param)
    param = param.replace(".tool_call_id", ".call_id")
    if param == "messages":
        return "input"
    for chat, ours in _FIELDS:
        if param.startswith(chat):
            return ours + param[len(chat):]
    return param


def as_responses_error(e: APIError, where: list[str]) -> APIError:
    if e.param is None:
        return e
    param = as_responses_param(e.param, where)
    message = e.message
    if message.startswith(e.param):
        message = param + message[len(e.param):]
    return APIError(e.status, message, e.type, param=param, code=e.code, headers=e.headers)
