"""OpenAI response bodies and stream chunks for one request (chat or text completion)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from services.api.outputs import FinishReason, Usage
from services.api.processor import TextLogprob, ToolCall


def usage_body(u: Usage | None) -> dict | None:
    if u is None:
        return None
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


class StreamUsage(StrEnum):
    """The usage a stream's chunks carry. ``none``: no usage key. ``last`` (OpenAI's
    ``stream_options.include_usage``): ``usage: null`` on every chunk, then one last chunk
    with no choices and the request's usage. ``every`` (vLLM's ``continuous_usage_stats``,
    with ``include_usage``): each chunk its choice's usage so far (its prompt's tokens and
    the tokens it generated up to that chunk), then the same last chunk."""

    NONE = "none"
    LAST = "last"
    EVERY = "every"


def running_usage_body(u: Usage) -> dict:
    # NOTE: no prompt_tokens_details: the cached count is known once the request ends.
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens}


@dataclass(slots=True)
class Choice:
    """One choice of a whole (not streamed) answer."""

    text: str = ""
    finish_reason: FinishReason | None = None
    logprobs: list[TextLogprob] = field(default_factory=list)
    tool_calls: tuple[ToolCall, ...] = ()


def tool_call_body(c: ToolCall) -> dict:
    return {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}


def logprob_entry(token: str, logprob: float, raw: bytes) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(raw)}


class Renderer:
    """``logprobs``: the request asked for them, so every choice carries a logprobs object
    (OpenAI's chat or completions shape), else null. ``usage``: what a stream's chunks carry."""

    def __init__(self, chat: bool, response_id: str, model: str, logprobs: bool = False,
                 usage: StreamUsage = StreamUsage.NONE) -> None:
        self.chat = chat
        self.id = response_id
        self.model = model
        self.created = int(time.time())
        self.logprobs = logprobs
        self.usage = usage
        self._text_offset: dict[int, int] = {}  # completions' text_offset, per choice

    def logprobs_body(self, lps: Sequence[TextLogprob], index: int = 0) -> dict | None:
        if not self.logprobs:
            return None
        if self.chat:
            return {"content": [{**logprob_entry(x.token, x.logprob, x.token_bytes),
                                 "top_logprobs": [logprob_entry(t, v, b) for (t, v), b
                                                  in zip(x.top, x.top_bytes, strict=True)]}
                                for x in lps],
                    "refusal": None}
        offsets = []
        at = self._text_offset.get(index, 0)
        for x in lps:
            offsets.append(at)
            at += len(x.token)
        self._text_offset[index] = at
        # NOTE: an echoed prompt's first token has no logprob: null, and null top logprobs
        # (OpenAI's and vLLM's shape).
        return {"tokens": [x.token for x in lps], "token_logprobs": [x.logprob for x in lps],
                "top_logprobs": [None if x.logprob is None else dict(x.top) for x in lps],
                "text_offset": offsets}

    def _base(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, choices: Sequence[Choice], usage: Usage | None) -> dict:
        out = []
        for i, c in enumerate(choices):
            lps = self.logprobs_body(c.logprobs, i)
            if self.chat:
                message: dict = {"role": "assistant", "content": c.text}
                reason: str | None = c.finish_reason
                if c.tool_calls:
                    message = {"role": "assistant", "content": c.text or None,
                               "tool_calls": [tool_call_body(t) for t in c.tool_calls]}
                    reason = _with_calls(c.finish_reason)
                out.append({"index": i, "message": message, "logprobs": lps,
                            "finish_reason": reason})
            else:
                out.append({"index": i, "text": c.text, "logprobs": lps,
                            "finish_reason": c.finish_reason})
        body = self._base("chat.completion" if self.chat else "text_completion")
        body["choices"] = out
        body["usage"] = usage_body(usage)
        return body

    def _chunk(self, delta: dict | str, finish_reason: FinishReason | str | None,
               running: Usage, logprobs: dict | None = None, index: int = 0) -> dict:
        if self.chat:
            body = self._base("chat.completion.chunk")
            body["choices"] = [{"index": index, "delta": delta, "logprobs": logprobs,
                                "finish_reason": finish_reason}]
        else:
            body = self._base("text_completion")
            body["choices"] = [{"index": index, "text": delta, "logprobs": logprobs,
                                "finish_reason": finish_reason}]
        if self.usage is StreamUsage.LAST:
            body["usage"] = None  # OpenAI: null on every chunk but the last
        elif self.usage is StreamUsage.EVERY:
            body["usage"] = running_usage_body(running)
        return body

    # ``running``: the choice's usage as of the chunk (StreamUsage.EVERY renders it).

    def chunk_role(self, running: Usage, index: int = 0) -> dict:
        return self._chunk({"role": "assistant", "content": ""} if self.chat else "", None,
                           running, index=index)

    def chunk_text(self, text: str, running: Usage, lps: Sequence[TextLogprob] = (),
                   index: int = 0) -> dict:
        return self._chunk({"content": text} if self.chat else text, None, running,
                           self.logprobs_body(lps, index), index)

    def chunk_tool_calls(self, calls: Sequence[ToolCall], running: Usage,
                         index: int = 0) -> dict:
        """Every call whole in one delta (the openai client assembles by ``index``)."""
        return self._chunk({"tool_calls": [dict(tool_call_body(c), index=i)
                                           for i, c in enumerate(calls)]}, None, running,
                           index=index)

    def chunk_finish(self, reason: FinishReason, running: Usage, index: int = 0,
                     tool_calls: bool = False) -> dict:
        return self._chunk({} if self.chat else "", _with_calls(reason) if tool_calls else reason,
                           running, index=index)

    def chunk_usage(self, usage: Usage) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        body = self._base(obj)
        body["choices"] = []
        body["usage"] = usage_body(usage)
        return body


def _with_calls(reason: FinishReason | None) -> str | None:
    """A choice's finish reason when it made calls: "tool_calls", but "length" where
    max_tokens cut the last call (its arguments then end where they were cut)."""
    return reason if reason is FinishReason.LENGTH else "tool_calls"
