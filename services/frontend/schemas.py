"""Request bodies of the OpenAI API (pydantic), and their translation to ProcessRequest.

Every field of OpenAI's chat-completions and completions requests is honoured, refused
with a 400 that names it (at any value but its no-op one: ``modalities: ["text"]`` is
fine), or ignored where the spec lets a server ignore it (``user``, ``metadata``: only
stored, and we store nothing); docs/api.md holds the table. Unknown fields are ignored.

Numbers and booleans are strict: ``"8"`` or ``true`` is no max_tokens, ``"true"`` no
stream (a client sending them has a bug worth a 400, not a guess); an integer is still a
float (``temperature: 1``), as every OpenAI client sends it. Strings must be valid Unicode,
and token ids fit the uint32 they travel as, so nothing past this point meets either.
"""

from __future__ import annotations

import functools
import json
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    field_validator,
    model_validator,
)

from services.api.images import ImageData
from services.api.processor import (
    ChatMessage,
    ChatRole,
    MessageImage,
    ProcessRequest,
    Tool,
    ToolChoice,
)
from services.api.sampling import MAX_N, MAX_TOP_LOGPROBS, SamplingParams
from services.api.structured import StructuredKind, StructuredOutput, check
from services.api.text import lone_surrogate
from services.common.errors import InvalidRequest
from services.frontend.render import StreamUsage
from services.frontend.structured import ResponseFormat, StructuredOutputsIn, structured_output
from services.processor.tools import (
    CLOSE,
    FORCED_CALL_MAX_TOKENS,
    OPEN,
    call_schema,
    strict_calls_grammar,
)


def _unicode(s: str) -> str:
    # NOTE: JSON's "\ud800" escape decodes to a lone surrogate, which no tokenizer, codec
    # or UTF-8 writer accepts. Refused rather than replaced by U+FFFD: a replaced stop
    # string or prompt would silently be another one, and the client has a bug to fix (an
    # encoder that split a UTF-16 pair, e.g. a truncated emoji).
    i = lone_surrogate(s)
    if i is not None:
        raise ValueError(f"contains a lone UTF-16 surrogate (U+{ord(s[i]):04X} at "
                         f"character {i}), which is not valid Unicode")
    return s


Text = Annotated[str, AfterValidator(_unicode)]
Int = Annotated[int, Strict()]
Float = Annotated[float, Strict()]  # strict float still takes an int, never a bool or a string
Bool = Annotated[bool, Strict()]
# Prompts of one completions request times its n: each is a request of its own in the
# cluster, all started at once.
MAX_PROMPT_CHOICES = 256
# Token ids cross gRPC as uint32; the processor checks them against the vocabulary.
TokenId = Annotated[int, Strict(), Field(ge=0, lt=2**32)]


class RequestBody(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(RequestBody):
    type: Literal["text"]
    text: Text


class ImageUrl(RequestBody):
    url: str = Field(min_length=1)
    detail: Literal["auto", "low", "high"] = "auto"  # accepted; the model's processor decides


class ImageUrlPart(RequestBody):
    type: Literal["image_url"]
    image_url: ImageUrl


ContentPart = TextPart | ImageUrlPart


class FunctionCallIn(RequestBody):
    name: Text
    arguments: Text


class ToolCallIn(RequestBody):
    type: Literal["function"] = "function"
    id: Text | None = None
    function: FunctionCallIn


class ChatMessageIn(RequestBody):
    role: ChatRole
    content: Text | list[ContentPart] | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's earlier calls
    tool_call_id: Text | None = None  # a tool message: the call it answers
    # Refused: an assistant's audio answer or a deprecated function call sent back.
    audio: Any = None
    function_call: Any = None

    def text(self) -> str:
        return self.text_and_images(0, {})[0]

    def image_urls(self) -> list[tuple[int, str]]:
        """(part index, url) of each image part."""
        if not isinstance(self.content, list):
            return []
        return [(j, p.image_url.url) for j, p in enumerate(self.content) if isinstance(p, ImageUrlPart)]

    def text_and_images(self, index: int, images: dict[tuple[int, int], ImageData]
                        ) -> tuple[str, tuple[MessageImage, ...]]:
        """The text, and each image (``images[(index, part)]``) at the character offset
        where its part sits in the text."""
        text: list[str] = []
        placed: list[MessageImage] = []
        if isinstance(self.content, str):
            text.append(self.content)
        elif self.content is not None:
            at = 0
            for j, p in enumerate(self.content):
                if isinstance(p, TextPart):
                    text.append(p.text)
                    at += len(p.text)
                else:
                    placed.append(MessageImage(at, images[(index, j)]))
        # NOTE: earlier calls go back to the model in the form it is asked to write them.
        for c in self.tool_calls or ():
            call = f'{{"name": {json.dumps(c.function.name)}, "arguments": {c.function.arguments}}}'
            text.append(f"{OPEN}\n{call}\n{CLOSE}")
        return "".join(text), tuple(placed)


class FunctionDef(RequestBody):
    name: Text = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    # Arguments exactly to the schema: a forced call's grammar gives it; under "auto" a
    # strict tool puts the answer under strict_calls_grammar (free text, or exact calls).
    strict: Bool | None = None


class ToolDef(RequestBody):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(RequestBody):
    name: Text


class NamedToolChoice(RequestBody):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(RequestBody):
    include_usage: Bool = False
    include_obfuscation: Bool | None = None  # ignored: our chunks carry no padding field
    # vLLM's: with include_usage, every chunk carries its choice's usage so far (guidellm
    # sends it on every streamed request, aiperf with --per-chunk-usage).
    continuous_usage_stats: Bool = False


def refused(field: str, why: str) -> ValueError:
    return ValueError(f"{field}: not supported ({why})")


class _Sampling(RequestBody):
    model: Text = Field(min_length=1)
    max_tokens: Int | None = Field(None, ge=1)
    temperature: Float | None = Field(None, ge=0, le=2)
    top_p: Float | None = Field(None, gt=0, le=1)
    top_k: Int | None = Field(None, ge=-1)  # -1 and 0: off (vLLM's and our convention)
    seed: Int | None = Field(None, ge=-(2**63), lt=2**63)
    stop: Text | list[Text] | None = None
    n: Int = Field(1, ge=1, le=MAX_N)
    best_of: Int | None = None
    stream: Bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Float | None = Field(None, ge=-2, le=2)
    frequency_penalty: Float | None = Field(None, ge=-2, le=2)
    # token id (a JSON object's keys are strings) -> bias added to its logit
    logit_bias: dict[str, Float] | None = None
    # Ignored by spec: identifiers for the caller's abuse tracking and cache routing (the
    # KV-aware router finds shared prefixes without a key).
    user: Text | None = None
    safety_identifier: Text | None = None
    prompt_cache_key: Text | None = None
    # vLLM's extras
    min_p: Float | None = Field(None, ge=0, le=1)
    stop_token_ids: list[TokenId] = Field(default_factory=list)
    ignore_eos: Bool = False
    repetition_penalty: Float | None = Field(None, gt=0)
    min_tokens: Int = Field(0, ge=0)
    # Structured output (frontend/structured.py): OpenAI's, then vLLM's new and old extras.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsIn | None = None
    guided_json: dict | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None

    @model_validator(mode="after")
    def _check_unsupported(self) -> _Sampling:
        if self.best_of is not None and self.best_of != 1:
            raise refused("best_of", "only best_of=1: the n choices are all returned")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        limit = self.requested_max_tokens()
        if limit is not None and self.min_tokens > limit:
            raise ValueError(f"min_tokens: must be at most max_tokens ({limit}), got {self.min_tokens}")
        return self

    def num_logprobs(self) -> int | None:
        """How many top logprobs per token (0: only the chosen token's); None: none."""
        return None

    def num_prompt_logprobs(self) -> int | None:
        """The same for the prompt's tokens (completions' echo)."""
        return None

    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        out: list[tuple[int, float]] = []
        for k, v in (self.logit_bias or {}).items():
            try:
                tok = int(k)
            except ValueError:
                raise InvalidRequest(f"logit_bias: keys must be token ids, got {k!r}",
                                     param="logit_bias", code="invalid_value") from None
            out.append((tok, v))
        return tuple(sorted(out))

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def stream_usage(self) -> StreamUsage:
        """vLLM's rule: continuous_usage_stats counts only with include_usage."""
        o = self.stream_options
        if o is None or not o.include_usage:
            return StreamUsage.NONE
        return StreamUsage.EVERY if o.continuous_usage_stats else StreamUsage.LAST

    def structured(self) -> StructuredOutput | None:
        """The request's output constraint; InvalidRequest if several or one that does
        not compile."""
        forced = self.forced_call()
        if forced is not None:
            return forced
        guided = {k: v for k in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
                  if (v := getattr(self, k)) is not None}
        return structured_output(self.response_format, self.structured_outputs, guided)

    def forced_call(self) -> StructuredOutput | None:
        """The tool-call constraint (chat with tool_choice "required" or a named tool)."""
        return None

    def sampling(self, max_tokens: int | None) -> SamplingParams:
        """The request's one sampling type; InvalidRequest names a value it refuses."""
        structured = self.structured()
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p, min_p=self.min_p or 0.0,
                top_k=max(self.top_k or 0, 0), seed=self.seed, stop=tuple(self.stop_list()),
                stop_token_ids=tuple(self.stop_token_ids), ignore_eos=self.ignore_eos,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                logit_bias=self.logit_bias_pairs(), min_tokens=self.min_tokens,
                logprobs=self.num_logprobs(), n=self.n, structured=structured,
                prompt_logprobs=self.num_prompt_logprobs())
        except ValueError as e:
            field = str(e).split(":", 1)[0]
            raise InvalidRequest(str(e), param=field, code="invalid_value") from None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(None, ge=1)
    logprobs: Bool | None = None
    top_logprobs: Int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolDef] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: Bool | None = None  # false: at most one call in the answer
    modalities: list[Literal["text", "audio"]] | None = None  # ["text"] only
    # Ignored by spec: stored with the completion (we store nothing; ``store: true`` is
    # refused) and prompt-cache hints (the prefix cache is automatic).
    metadata: dict[str, Text] | None = None
    prompt_cache_retention: Text | None = None
    prompt_cache_options: Any = None
    # Refused unless null (or their no-op value): nothing here can honour them.
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    functions: Any = None
    function_call: Any = None
    moderation: Any = None
    reasoning_effort: Text | None = None
    verbosity: Text | None = None
    store: Bool | None = None
    service_tier: Text | None = None

    @model_validator(mode="after")
    def _check_refused(self) -> ChatCompletionRequest:
        why = {
            "audio": "text output only", "prediction": "no predicted outputs",
            "web_search_options": "no web search", "moderation": "no moderation",
            "functions": "deprecated: send tools", "function_call": "deprecated: send tool_choice",
            "reasoning_effort": "not a reasoning model",
        }
        for name, reason in why.items():
            if getattr(self, name) is not None:
                raise refused(name, reason)
        if self.modalities is not None and self.modalities != ["text"]:
            raise refused("modalities", 'only ["text"]')
        if self.verbosity not in (None, "medium"):
            raise refused("verbosity", "the model's answer length is its own; only \"medium\"")
        if self.store:
            raise refused("store", "completions are not stored")
        if self.service_tier not in (None, "auto", "default"):
            raise refused("service_tier", 'one tier: "auto" or "default"')
        for i, m in enumerate(self.messages):
            for name in ("audio", "function_call"):
                if getattr(m, name) is not None:
                    raise refused(f"messages.{i}.{name}",
                                   "no audio" if name == "audio" else "deprecated: send tool_calls")
        return self

    @model_validator(mode="after")
    def _check_tool_call_ids(self) -> ChatCompletionRequest:
        """A tool message answers a call an earlier assistant message made."""
        made: set[str] = set()
        for i, m in enumerate(self.messages):
            if m.role == "assistant":
                made.update(c.id for c in m.tool_calls or () if c.id is not None)
            elif m.role == "tool":
                if m.tool_call_id is None:
                    raise ValueError(f"messages.{i}.tool_call_id: a tool message must name the "
                                     "call it answers")
                if m.tool_call_id not in made:
                    raise ValueError(f"messages.{i}.tool_call_id: {m.tool_call_id!r} names no "
                                     "tool call of an earlier assistant message")
        return self

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: logprobs must be true when top_logprobs is given")
        return self

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @model_validator(mode="after")
    def _check_tools(self) -> ChatCompletionRequest:
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be unique")
        tc = self.tool_choice
        if isinstance(tc, NamedToolChoice) and tc.function.name not in names:
            raise ValueError(f"tool_choice: names the function {tc.function.name!r}, which is "
                             "not in tools")
        if tc == "required" and not names:
            raise ValueError("tool_choice: \"required\" needs tools")
        return self

    def tool_list(self) -> tuple[Tool, ...]:
        return tuple(Tool(t.function.name, t.function.description or "",
                          json.dumps(t.function.parameters) if t.function.parameters is not None else "")
                     for t in self.tools or ())

    def choice(self) -> ToolChoice:
        tc = self.tool_choice
        if isinstance(tc, NamedToolChoice):
            return ToolChoice("function", tc.function.name)
        if not self.tools:
            return ToolChoice("none")
        return ToolChoice(tc or "auto")

    def forced_call(self) -> StructuredOutput | None:
        """The calls' constraint: with tool_choice "required" or a named function, one
        call's JSON; with "auto" and a strict tool, free text or calls whose arguments
        follow their schemas (``strict_calls_grammar``); else none."""
        choice = self.choice()
        strict = choice.mode == "auto" and any(t.function.strict for t in self.tools or ())
        if choice.mode not in ("required", "function") and not strict:
            return None
        others = [n for n in ("response_format", "structured_outputs", "guided_json",
                              "guided_regex", "guided_choice", "guided_grammar")
                  if getattr(self, n) is not None and not (
                      n == "response_format" and self.response_format.type == "text")]
        if others:
            what = "strict tools" if strict else f"a forced tool call (tool_choice {choice.mode!r})"
            raise InvalidRequest(f"{others[0]}: cannot be combined with {what}",
                                 param=others[0], code="invalid_value")
        try:
            spec = (StructuredOutput(StructuredKind.GRAMMAR, strict_calls_grammar(
                        self.tool_list(), parallel=self.parallel_tool_calls is not False))
                    if strict else StructuredOutput.json_schema(call_schema(self.tool_list(), choice)))
            check(spec)
        except ValueError as e:
            raise InvalidRequest(f"tools: a function's parameters schema does not compile: {e}",
                                 param="tools", code="invalid_value") from None
        return spec

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def image_urls(self) -> list[tuple[int, int, str]]:
        """(message index, part index, url) of every image part, in order."""
        return [(i, j, url) for i, m in enumerate(self.messages) for j, url in m.image_urls()]

    def to_process(self, request_id: str, images: dict[tuple[int, int], ImageData] | None = None) -> ProcessRequest:
        """``images``: every image part's checked image by (message, part) index."""
        # max_completion_tokens is the newer name; it wins when both are given.
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if limit is None and self.choice().mode in ("required", "function"):
            limit = FORCED_CALL_MAX_TOKENS
        msgs = tuple(ChatMessage(m.role, *m.text_and_images(i, images or {})) for i, m in enumerate(self.messages))
        return ProcessRequest(request_id, messages=msgs, sampling=self.sampling(limit), model=self.model,
                              tools=self.tool_list(), tool_choice=self.choice(),
                              parallel_tool_calls=self.parallel_tool_calls is not False)


class CompletionRequest(_Sampling):
    # One prompt or several (a choice per prompt per n): text, or token ids.
    prompt: Text | list[Text] | list[TokenId] | list[list[TokenId]]
    # OpenAI's default for /v1/completions; 0 (with echo): the prompt only
    max_tokens: Int | None = Field(16, ge=0)
    echo: Bool = False
    suffix: Text | None = None
    logprobs: Int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def num_prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_kind(cls, v: Any) -> Any:
        # NOTE: else pydantic reports the first member's complaint ("prompt.0: Input should
        # be a valid string" for a mixed list), which misleads a token-id caller.
        if isinstance(v, list) and len({type(x) for x in v}) > 1:
            raise ValueError("prompt: a list of prompts holds one kind: strings, token ids "
                             "(integers) or lists of token ids")
        return v

    @model_validator(mode="after")
    def _check_prompt(self) -> CompletionRequest:
        p = self.prompt
        if isinstance(p, list):
            if not p:
                raise ValueError("prompt: must not be empty")
            if isinstance(p[0], list) and not all(p):
                raise ValueError("prompt: a token-id prompt must not be empty")
            if len(p) * self.n > MAX_PROMPT_CHOICES and not isinstance(p[0], int):
                raise ValueError(f"prompt: at most {MAX_PROMPT_CHOICES} prompts times n choices "
                                 f"per request, got {len(p)} x {self.n}")
        if self.suffix:
            raise refused("suffix", "no fill-in-the-middle")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 asks for the prompt alone, which needs echo: true")
        return self

    def prompts(self) -> list[str | tuple[int, ...]]:
        """Each prompt: its text or its token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):
            return [tuple(p)]  # type: ignore[arg-type]
        return [x if isinstance(x, str) else tuple(x) for x in p]  # type: ignore[misc]

    def to_processes(self, request_id: str) -> list[ProcessRequest]:
        """One ProcessRequest per prompt (ids ``request_id``, or ``request_id-i`` for
        several)."""
        prompts = self.prompts()
        sampling = self.sampling(self.max_tokens)
        return [ProcessRequest(request_id if len(prompts) == 1 else f"{request_id}-{i}",
                               prompt=p if isinstance(p, str) else None,
                               prompt_ids=None if isinstance(p, str) else p,
                               sampling=sampling, model=self.model, echo=self.echo)
                for i, p in enumerate(prompts)]


@functools.cache
def body_field_names() -> frozenset[str]:
    """Every field name of every body model: what a validation error's location may name
    (its other parts are pydantic's names for union members)."""
    names: set[str] = set()
    todo: list[type[RequestBody]] = [RequestBody]
    while todo:
        cls = todo.pop()
        names.update(cls.model_fields)
        todo.extend(cls.__subclasses__())
    return frozenset(names)
