"""Stage 5: a request's deltas read for tool calls, one parser per choice (made as the
choice's first delta comes). The text of a call is held back; the choice's last delta
carries the calls, a call cut by max_tokens too (finish reason "length")."""

from __future__ import annotations

from dataclasses import replace

from services.api.outputs import FinishReason
from services.api.processor import Delta, ProcessRequest, Tool, ToolChoice
from services.processor.tools import ToolCallParser


class ToolCallStage:
    def __init__(self, tools: tuple[Tool, ...], choice: ToolChoice, parallel: bool = True) -> None:
        self._tools = tools
        self._choice = choice
        self._parallel = parallel
        self._parsers: dict[int, ToolCallParser] = {}

    @classmethod
    def for_request(cls, req: ProcessRequest) -> ToolCallStage | None:
        """None where the request offers no tools to call."""
        if not req.tools or req.tool_choice.mode == "none":
            return None
        return cls(req.tools, req.tool_choice, req.parallel_tool_calls)

    def apply(self, d: Delta) -> Delta | None:
        """``d`` with its text through its choice's parser; None when nothing is left to send."""
        parser = self._parsers.get(d.index)
        if parser is None:
            parser = self._parsers[d.index] = ToolCallParser(self._tools, self._choice)
        text = parser.feed(d.text)
        if d.finish_reason is None:
            d = replace(d, text=text)
        else:
            rest, calls = parser.finish(cut=d.finish_reason is FinishReason.LENGTH)
            # NOTE: parallel_tool_calls false: the first call the model wrote, alone.
            d = replace(d, text=text + rest, tool_calls=calls if self._parallel else calls[:1])
        if not d.text and not d.logprobs and d.finish_reason is None and d.usage is None:
            return None
        return d
