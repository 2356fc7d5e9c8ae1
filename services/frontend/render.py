"""OpenAI response bodies and stream chunks for one request (chat or text completion)."""

from __future__ import annotations

import time
from collections.abc import Sequence

from services.engine.request import FinishReason, Usage
from services.processor.types import ToolCall


def usage_body(u: Usage | None) -> dict | None:
    if u is None:
        return None
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def tool_call_body(c: ToolCall) -> dict:
    return {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}


class Renderer:
    def __init__(self, chat: bool, response_id: str, model: str) -> None:
        self.chat = chat
        self.id = response_id
        self.model = model
        self.created = int(time.time())

    def _base(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, text: str, finish_reason: FinishReason, usage: Usage | None,
             tool_calls: Sequence[ToolCall] = ()) -> dict:
        if self.chat:
            message: dict = {"role": "assistant", "content": text}
            reason: str = finish_reason
            if tool_calls:
                message = {"role": "assistant", "content": text or None,
                           "tool_calls": [tool_call_body(c) for c in tool_calls]}
                reason = "tool_calls"
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": reason}
            body = self._base("chat.completion")
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            body = self._base("text_completion")
        body["choices"] = [choice]
        body["usage"] = usage_body(usage)
        return body

    def _chunk(self, delta: dict | str, finish_reason: FinishReason | str | None,
               include_usage: bool) -> dict:
        if self.chat:
            body = self._base("chat.completion.chunk")
            body["choices"] = [{"index": 0, "delta": delta, "logprobs": None,
                                "finish_reason": finish_reason}]
        else:
            body = self._base("text_completion")
            body["choices"] = [{"index": 0, "text": delta, "logprobs": None,
                                "finish_reason": finish_reason}]
        if include_usage:
            body["usage"] = None  # OpenAI: null on every chunk but the last
        return body

    def chunk_role(self) -> dict:
        return self._chunk({"role": "assistant", "content": ""} if self.chat else "", None, False)

    def chunk_text(self, text: str, include_usage: bool) -> dict:
        return self._chunk({"content": text} if self.chat else text, None, include_usage)

    def chunk_tool_calls(self, calls: Sequence[ToolCall], include_usage: bool) -> dict:
        """Every call whole in one delta (the openai client assembles by ``index``)."""
        return self._chunk({"tool_calls": [dict(tool_call_body(c), index=i)
                                           for i, c in enumerate(calls)]}, None, include_usage)

    def chunk_finish(self, reason: FinishReason, include_usage: bool,
                     tool_calls: bool = False) -> dict:
        return self._chunk({} if self.chat else "", "tool_calls" if tool_calls else reason,
                           include_usage)

    def chunk_usage(self, usage: Usage) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        body = self._base(obj)
        body["choices"] = []
        body["usage"] = usage_body(usage)
        return body
