"""Responses API bodies and stream events for one request (``POST /v1/responses``).

The answer's output items, in the order the model made them: a ``message`` with one
``output_text`` part when it wrote text, then one ``function_call`` item per call. A
response cut by ``max_output_tokens`` is ``"incomplete"`` (``incomplete_details.reason``
``"max_output_tokens"``), its last item too.

Streamed, the events are OpenAI's, each ``event: <type>`` with its JSON and a
``sequence_number``: ``response.created`` and ``response.in_progress``; the message's
``output_item.added``, ``content_part.added``, one ``output_text.delta`` per delta and the
``.done`` events as it ends; each call's ``output_item.added``,
``function_call_arguments.delta`` and ``.done`` and ``output_item.done``; then
``response.completed`` with the whole response (an incomplete one too, as vLLM and SGLang
send it). An error after the start is an ``error`` event, then ``response.failed``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from typing import Any

from services.api.outputs import FinishReason, Usage
from services.api.processor import Delta, TextLogprob, ToolCall
from services.frontend.errors import APIError
from services.frontend.render import Choice, logprob_entry
from services.frontend.responses import ResponsesRequest


def usage_body(u: Usage | None) -> dict | None:
    if u is None:
        return None
    return {"input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.total_tokens}


def logprobs_body(lps: Sequence[TextLogprob]) -> list[dict]:
    return [{**logprob_entry(x.token, x.logprob, x.token_bytes),
             "top_logprobs": [logprob_entry(t, v, b)
                              for (t, v), b in zip(x.top, x.top_bytes, strict=True)]}
            for x in lps]


class ResponseRenderer:
    def __init__(self, req: ResponsesRequest, request_id: str) -> None:
        self.req = req
        self.id = "resp_" + request_id
        self.message_id = "msg_" + request_id
        self.created = int(time.time())
        self.logprobs = req.logprobs

    def call_id(self, i: int) -> str:
        return f"fc_{self.id.removeprefix('resp_')}_{i}"

    def body(self, status: str, output: list[dict], usage: Usage | None = None,
             error: APIError | None = None) -> dict:
        """The response object, its request's settings echoed as OpenAI does."""
        q = self.req
        fmt = q.text.format if q.text is not None and q.text.format is not None else None
        tc = q.tool_choice
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "background": False,
            "error": None if error is None else {"code": error.code or error.type,
                                                 "message": error.message},
            "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete"
                                   else None),
            "instructions": q.instructions, "max_output_tokens": q.max_output_tokens,
            "max_tool_calls": None, "model": q.model, "output": output,
            "parallel_tool_calls": q.parallel_tool_calls is not False,
            "previous_response_id": None, "reasoning": {"effort": None, "summary": None},
            "service_tier": "default", "store": False,
            "temperature": 1.0 if q.temperature is None else q.temperature,
            "text": {"format": ({"type": "text"} if fmt is None
                                else fmt.model_dump(by_alias=True, exclude_none=True)),
                     "verbosity": "medium"},
            "tool_choice": tc.model_dump() if tc is not None and not isinstance(tc, str)
            else tc or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in q.tools or ()],
            "top_logprobs": q.top_logprobs or 0, "top_p": 1.0 if q.top_p is None else q.top_p,
            "truncation": "disabled", "usage": usage_body(usage), "user": q.user,
            "metadata": q.metadata or {},
        }

    def message(self, text: str, lps: Sequence[TextLogprob], status: str) -> dict:
        return {"id": self.message_id, "type": "message", "status": status, "role": "assistant",
                "content": [self.text_part(text, lps)]}

    def text_part(self, text: str, lps: Sequence[TextLogprob]) -> dict:
        return {"type": "output_text", "text": text, "annotations": [],
                "logprobs": logprobs_body(lps)}

    def call(self, i: int, c: ToolCall, status: str, arguments: str | None = None) -> dict:
        return {"id": self.call_id(i), "type": "function_call", "status": status,
                "call_id": c.id, "name": c.name,
                "arguments": c.arguments if arguments is None else arguments}

    def full(self, choice: Choice, usage: Usage | None) -> dict:
        status = _status(choice.finish_reason)
        output: list[dict] = []
        if choice.text or not choice.tool_calls:
            # NOTE: the last item is what the limit cut: the message only without calls.
            output.append(self.message(choice.text, choice.logprobs,
                                       "completed" if choice.tool_calls else status))
        output += [self.call(i, c, status if i == len(choice.tool_calls) - 1 else "completed")
                   for i, c in enumerate(choice.tool_calls)]
        return self.body(status, output, usage)


def _status(reason: FinishReason | None) -> str:
    return "incomplete" if reason is FinishReason.LENGTH else "completed"


class ResponseEvents:
    """The Responses API's stream (streaming.StreamEvents)."""

    def __init__(self, r: ResponseRenderer) -> None:
        self._r = r
        self._seq = 0
        self._output: list[dict] = []  # the items done
        self._text: list[str] | None = None  # the message's text while it is open
        self._lps: list[TextLogprob] = []

    def _event(self, kind: str, **fields: Any) -> str:
        obj = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return (f"event: {kind}\n"
                f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n")

    def opening(self, first: Delta) -> Iterator[str]:
        body = self._r.body("in_progress", [])
        yield self._event("response.created", response=body)
        yield self._event("response.in_progress", response=body)

    def _open_message(self) -> Iterator[str]:
        """The message item and its text part, empty, before their first text."""
        r = self._r
        self._text = []
        yield self._event("response.output_item.added", output_index=len(self._output),
                          item={**r.message("", (), "in_progress"), "content": []})
        yield self._event("response.content_part.added", item_id=r.message_id,
                          output_index=len(self._output), content_index=0,
                          part=r.text_part("", ()))

    def delta(self, d: Delta, last: bool) -> Iterator[str]:
        r = self._r
        if d.text or d.logprobs:
            if self._text is None:
                yield from self._open_message()
            assert self._text is not None
            self._text.append(d.text)
            self._lps.extend(d.logprobs)
            yield self._event("response.output_text.delta", item_id=r.message_id,
                              output_index=len(self._output), content_index=0, delta=d.text,
                              logprobs=logprobs_body(d.logprobs))
        if d.finish_reason is None:
            return
        status = _status(d.finish_reason)
        if self._text is None and not d.tool_calls:
            yield from self._open_message()  # an empty answer is still a message
        if self._text is not None:
            text = "".join(self._text)
            at = len(self._output)
            yield self._event("response.output_text.done", item_id=r.message_id,
                              output_index=at, content_index=0, text=text,
                              logprobs=logprobs_body(self._lps))
            yield self._event("response.content_part.done", item_id=r.message_id,
                              output_index=at, content_index=0,
                              part=r.text_part(text, self._lps))
            item = r.message(text, self._lps, "completed" if d.tool_calls else status)
            self._output.append(item)
            yield self._event("response.output_item.done", output_index=at, item=item)
        for i, c in enumerate(d.tool_calls):
            at = len(self._output)
            yield self._event("response.output_item.added", output_index=at,
                              item=r.call(i, c, "in_progress", ""))
            yield self._event("response.function_call_arguments.delta", item_id=r.call_id(i),
                              output_index=at, delta=c.arguments)
            yield self._event("response.function_call_arguments.done", item_id=r.call_id(i),
                              output_index=at, name=c.name, arguments=c.arguments)
            item = r.call(i, c, status if i == len(d.tool_calls) - 1 else "completed")
            self._output.append(item)
            yield self._event("response.output_item.done", output_index=at, item=item)
        if last:
            # NOTE: response.completed for an incomplete response too (its status says so),
            # as vLLM and SGLang send it: aiperf reads the usage from that event only, and
            # OpenAI's response.incomplete left it without token counts.
            yield self._event("response.completed", response=r.body(status, self._output, d.usage))

    def failed(self, err: APIError) -> Iterator[str]:
        yield self._event("error", code=err.code or err.type, message=err.message,
                          param=err.param)
        yield self._event("response.failed", response=self._r.body("failed", self._output,
                                                                   error=err))

    def closing(self) -> Iterator[str]:
        return iter(())
