"""The processor's API: a request in (chat messages, a prompt or token ids, with the
engine's SamplingParams), text deltas out. The frontend renders ``Delta`` as it comes;
proto/processor.proto carries both (services/codec/processor.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from services.engine.multimodal.image_input import ImageData
from services.engine.request import FinishReason, SamplingParams, Usage

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
class ProcessRequest:
    """Exactly one of ``messages`` (chat), ``prompt`` (text) or ``prompt_ids`` is set."""

    request_id: str
    messages: tuple[ChatMessage, ...] | None = None
    prompt: str | None = None
    prompt_ids: tuple[int, ...] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    model: str = ""  # "" = the served model


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
