"""The processor's in-process API types; proto/processor.proto mirrors them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


class ProcessorError(Exception):
    """Base of the processor's typed errors. ``code``/``param`` refine it for the API
    (OpenAI's error ``code`` and ``param``); they cross gRPC as trailing metadata."""

    kind = "internal"

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param


class InvalidRequest(ProcessorError):
    """Bad input: empty prompt, bad sampling parameters, prompt longer than the context."""

    kind = "invalid_request"


class ModelNotFound(ProcessorError):
    """The request names a model this cluster does not serve."""

    kind = "model_not_found"


class Unavailable(ProcessorError):
    """No router or no decode worker can take the request now (retry later)."""

    kind = "unavailable"


class Overloaded(Unavailable):
    """The chosen decode worker refused the request: its queue is full (HTTP 429)."""

    kind = "overloaded"


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True, slots=True)
class SamplingOptions:
    """What the API lets a client choose. ``max_tokens`` None: up to the context length."""

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ProcessRequest:
    """Exactly one of ``messages`` (chat), ``prompt`` (text) or ``prompt_ids`` is set."""

    request_id: str
    messages: tuple[ChatMessage, ...] | None = None
    prompt: str | None = None
    prompt_ids: tuple[int, ...] | None = None
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    model: str = ""  # "" = the served model


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


FinishReason = Literal["stop", "length"]


@dataclass(frozen=True, slots=True)
class Delta:
    """New text since the previous delta; the last one carries finish_reason and usage."""

    text: str
    finish_reason: FinishReason | None = None
    usage: Usage | None = None


@dataclass(frozen=True, slots=True)
class ModelInfo:
    id: str
    context_length: int
