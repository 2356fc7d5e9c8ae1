"""The processor's API: a request in (chat messages, a prompt or token ids, with the
SamplingParams), text deltas out. The frontend renders ``Delta`` as it comes;
proto/processor.proto carries both (processor_codec.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from services.api.images import ImageData
from services.api.outputs import FinishReason, Usage
from services.api.sampling import SamplingParams

ChatRole = Literal["system", "developer", "user", "assistant", "tool"]
CHAT_ROLES: frozenset[str] = frozenset(get_args(ChatRole))


@dataclass(frozen=True, slots=True)
class MessageImage:
    """An image of a chat message, placed before ``content[char_offset]``."""

    char_offset: int
    image: ImageData


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str  # one of CHAT_ROLES; the processor checks it where the request enters
    content: str
    images: tuple[MessageImage, ...] = ()


@dataclass(frozen=True, slots=True)
class Tool:
    """A function the model may call (OpenAI's ``tools[].function``)."""

    name: str
    description: str = ""
    parameters: str = ""  # its arguments' JSON schema, as JSON text; "" = any object


ToolChoiceMode = Literal["none", "auto", "required", "function"]


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """``function``: call the tool named ``name``; ``required``: call one of them;
    ``auto``: the model decides (tools rendered in the prompt, its ``<tool_call>`` parsed);
    ``none``: no tools."""

    mode: ToolChoiceMode = "auto"
    name: str = ""


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI's tool_calls carry it


@dataclass(frozen=True, slots=True)
class ProcessRequest:
    """Exactly one of ``messages`` (chat), ``prompt`` (text) or ``prompt_ids`` is set."""

    request_id: str
    messages: tuple[ChatMessage, ...] | None = None
    prompt: str | None = None
    prompt_ids: tuple[int, ...] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    model: str = ""  # "" = the served model
    tools: tuple[Tool, ...] = ()  # chat only
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    # Completions only: each choice's text starts with the prompt's and, with
    # sampling.prompt_logprobs, its logprobs with the prompt tokens'.
    echo: bool = False
    # Chat only: False answers with at most one tool call (the first the model wrote).
    parallel_tool_calls: bool = True


@dataclass(frozen=True, slots=True)
class TextLogprob:
    """A token as text (the decoding of that one token), its logprob and the ``top``
    alternatives' ((text, logprob), ...), most likely first. ``logprob`` None: an echoed
    prompt's first token, which nothing predicts. ``token_bytes`` and ``top_bytes`` (one
    per ``top`` entry): the tokens' raw bytes, where the text of a token holding part of a
    UTF-8 character is U+FFFD."""

    token: str
    logprob: float | None
    top: tuple[tuple[str, float], ...] = ()
    token_bytes: bytes = b""
    top_bytes: tuple[bytes, ...] = ()


@dataclass(frozen=True, slots=True)
class Delta:
    """New text since the previous delta; the last one carries finish_reason and usage.
    With sampling.logprobs, ``logprobs`` are those of the tokens received since the
    previous delta (the text of a token may come out in a later delta than its logprob
    when the detokenizer or a stop string holds it back)."""

    text: str
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    # Parsed calls, on the last delta (then finish_reason is STOP, the API says "tool_calls").
    tool_calls: tuple[ToolCall, ...] = ()
    logprobs: tuple[TextLogprob, ...] = ()
    index: int = 0  # the choice, for sampling.n > 1
    # The choice's completion tokens so far (including any whose text is still held back)
    # and its prompt's tokens: a streamed chunk's usage with continuous_usage_stats.
    tokens: int = 0
    prompt_tokens: int = 0

    def ends_request(self, n: int) -> bool:
        """The request's last delta: with n = 1 the one with the finish reason; with n > 1
        each choice's finish comes apart, and the last delta is the one with the usage."""
        return self.usage is not None or (n == 1 and self.finish_reason is not None)


@dataclass(frozen=True, slots=True)
class ModelInfo:
    id: str
    context_length: int
