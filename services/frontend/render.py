"""OpenAI response bodies and stream chunks for one request (chat or text completion)."""

from __future__ import annotations

import time

from services.engine.request import FinishReason, Usage


def usage_body(u: Usage | None) -> dict | None:
    if u is None:
        return None
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


class Renderer:
    def __init__(self, chat: bool, response_id: str, model: str) -> None:
        self.chat = chat
        self.id = response_id
        self.model = model
        self.created = int(time.time())

    def _base(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, text: str, finish_reason: FinishReason, usage: Usage | None) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": finish_reason}
            body = self._base("chat.completion")
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            body = self._base("text_completion")
        body["choices"] = [choice]
        body["usage"] = usage_body(usage)
        return body

    def _chunk(self, delta: dict | str, finish_reason: FinishReason | None,
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

    def chunk_finish(self, reason: FinishReason, include_usage: bool) -> dict:
        return self._chunk({} if self.chat else "", reason, include_usage)

    def chunk_usage(self, usage: Usage) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        body = self._base(obj)
        body["choices"] = []
        body["usage"] = usage_body(usage)
        return body
