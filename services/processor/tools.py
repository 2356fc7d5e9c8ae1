"""Tool calling: the tools in the prompt, the constraint that forces a call, and the calls
read back out of the model's text.

``required`` and a named function constrain the output to one call's JSON,
``{"name": ..., "arguments": {...}}`` (``call_schema``), so it always parses: its arguments
follow the function's schema with no keys the schema does not allow (api/json_schema.py),
and without a ``max_tokens`` it stops at ``FORCED_CALL_MAX_TOKENS``. ``auto``
leaves the model free: the tools are rendered into the prompt (through the chat template
when it takes ``tools``, else as the standard system prompt below, the Hermes/Qwen form
many models are tuned on) and a ``<tool_call>{...}</tool_call>`` in its text becomes a call.
A call cut by ``max_tokens`` is still a call, its arguments as far as they were written.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from services.api.json_schema import for_grammar
from services.api.processor import Tool, ToolCall, ToolChoice

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*(?:" + re.escape(CLOSE) + r"|$)", re.DOTALL)
# A call's JSON as far as it was written: the name (maybe cut), its closing quote, the
# arguments' text.
_CUT = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)(")?(?:\s*,\s*"(?:arguments|parameters)"'
                  r"\s*:\s*(.*))?", re.DOTALL)
# A forced call's tokens when the request sets no max_tokens: a schema with free strings or
# recursion would otherwise let a model write until the request times out.
FORCED_CALL_MAX_TOKENS = 1024


def tool_dicts(tools: Sequence[Tool]) -> list[dict[str, Any]]:
    """OpenAI's ``tools`` shape, what chat templates that take tools expect."""
    return [{"type": "function", "function": {
        "name": t.name, "description": t.description, "parameters": parameters(t)}}
        for t in tools]


def parameters(t: Tool) -> dict[str, Any]:
    """The function's parameters schema; none given: no parameters (OpenAI's meaning)."""
    return json.loads(t.parameters) if t.parameters else {"type": "object", "properties": {}}


def system_prompt(tools: Sequence[Tool]) -> str:
    listing = "\n".join(json.dumps(d, ensure_ascii=False) for d in tool_dicts(tools))
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{listing}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments "
            f"within {OPEN}{CLOSE} XML tags:\n{OPEN}\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n' + CLOSE)


def with_tool_prompt(messages: list[dict[str, Any]], tools: Sequence[Tool]) -> list[dict[str, Any]]:
    """``messages`` with the tools' system prompt: before the caller's system message's
    text when there is one, else as a new first message."""
    prompt = system_prompt(tools)
    if messages and messages[0].get("role") in ("system", "developer"):
        first = dict(messages[0], content=f"{messages[0].get('content') or ''}\n\n{prompt}".lstrip())
        return [first, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def call_schema(tools: Sequence[Tool], choice: ToolChoice) -> dict[str, Any]:
    """The JSON schema of one call under ``choice`` (``required`` or ``function``)."""
    def one(t: Tool) -> dict[str, Any]:
        return {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                "properties": {"name": {"const": t.name}, "arguments": parameters(t)}}

    if choice.mode == "function":
        return one(next(t for t in tools if t.name == choice.name))
    return one(tools[0]) if len(tools) == 1 else {"anyOf": [one(t) for t in tools]}


def strict_calls_grammar(tools: Sequence[Tool], parallel: bool = True) -> str:
    """The llguidance (Lark) grammar of an answer under ``auto`` with strict tools: free
    text that never writes ``<tool_call>``, or that text followed by calls (one call where
    not ``parallel``), each ``<tool_call>`` + one call's compact JSON (``call_schema``: the
    arguments exactly to their schema) + ``</tool_call>``, with a little whitespace around
    them and nothing after.

    NOTE: a lexeme is greedy, so free text that could hold the opening tag would swallow
    it; the text's pattern excludes it instead (a regular language, written out below)."""
    schema = for_grammar(call_schema(tools, ToolChoice("required")))
    schema["x-guidance"] = {"whitespace_flexible": False}  # compact, as structured.py's JSON
    # NOTE: escaped so that no "::=" in a description reads as GBNF (structured.py).
    body = json.dumps(schema).replace("::=", ":\\u003a=")
    text = _without(OPEN)
    ws = "[ \\t\\n]{0,4}"
    return "\n".join((
        "start: TEXT | OPENING body CLOSING " + ("(OPEN_TAG body CLOSING)* " if parallel else "")
        + "TRAIL?",
        f"body: %json {body}",
        f"TEXT: /{text}/",
        f"OPENING: /{text}{_lit(OPEN)}{ws}/",
        f"OPEN_TAG: /{ws}{_lit(OPEN)}{ws}/",
        f"CLOSING: /{ws}{_lit(CLOSE)}/",
        "TRAIL: /[ \\t\\n]{1,4}/",
    ))


def _lit(s: str) -> str:
    """``s`` as a literal inside a Lark ``/regex/``."""
    return "".join("\\" + c if c in "\\.^$*+?()[]{}|/-" else c for c in s)


def _without(word: str) -> str:
    """A regex of the strings in which ``word`` never occurs (its first character must not
    recur in it: then a mismatch only ever restarts at that character). A string is
    characters other than the first, and runs of the word's proper prefixes each ended by
    a character that breaks it, and may end in such a prefix."""
    first, rest = word[0], word[1:]
    assert first not in rest
    prefixes = [first + rest[:k] for k in range(len(rest))]
    broken = [f"{_lit(p)}[^{_lit(rest[k])}{_lit(first)}]" for k, p in enumerate(prefixes)]
    open_ = "(" + "|".join(_lit(p) for p in prefixes) + ")"
    return f"(([^{_lit(first)}]|{open_}*({'|'.join(broken)}))*{open_}*)"


def _call(obj: Any, names: set[str]) -> ToolCall | None:
    if not isinstance(obj, Mapping) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(args, Mapping):
        return None
    return ToolCall(_call_id(), str(obj["name"]), json.dumps(args, ensure_ascii=False))


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _cut_call(text: str, names: Sequence[str]) -> ToolCall | None:
    """The call a ``text`` cut by max_tokens began: the function it names (or, its name
    cut, the one function it can still be) with the arguments as far as written; None when
    that is not one function."""
    m = _CUT.match(text)
    written = m.group(1) if m is not None else ""
    whole = m is not None and m.group(2) is not None
    fits = [n for n in names if (n == written if whole else n.startswith(written))]
    if len(fits) != 1:
        return None
    args = m.group(3) if m is not None and m.group(3) is not None else ""
    return ToolCall(_call_id(), fits[0], args)


class ToolCallParser:
    """Turns one request's text stream into content and calls. ``feed`` returns the
    content that may be streamed now (none once a call may have started; with a forced
    call, none at all); ``finish`` the rest and the calls. Without a parsable call the
    held text comes back as content."""

    def __init__(self, tools: Sequence[Tool], choice: ToolChoice) -> None:
        self.names = {t.name for t in tools}
        # The functions the answer may call: a named choice allows only its own.
        self.callable = [choice.name] if choice.mode == "function" else [t.name for t in tools]
        self.forced = choice.mode in ("required", "function")
        self._held = ""
        self._in_call = self.forced

    def feed(self, text: str) -> str:
        if self._in_call:
            self._held += text
            return ""
        buf = self._held + text
        i = buf.find(OPEN)
        if i >= 0:
            self._in_call, self._held = True, buf[i:]
            return buf[:i]
        # Hold a tail that may still become "<tool_call>".
        keep = next((n for n in range(min(len(OPEN) - 1, len(buf)), 0, -1)
                     if OPEN.startswith(buf[-n:])), 0)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep]

    def finish(self, cut: bool = False) -> tuple[str, tuple[ToolCall, ...]]:
        """``cut``: the text ended at max_tokens, so its last call may be unfinished."""
        held, self._held = self._held, ""
        if self.forced:
            try:
                call = _call(json.loads(held), self.names)
            except json.JSONDecodeError:
                call = _cut_call(held, self.callable) if cut else None
            return ("", (call,)) if call is not None else (held, ())
        calls: list[ToolCall] = []
        for m in _CALL.finditer(held):
            try:
                call = _call(json.loads(m.group(1)), self.names)
            except json.JSONDecodeError:
                unclosed = m.end() == len(held) and not held.endswith(CLOSE)
                call = _cut_call(m.group(1), self.callable) if cut and unclosed else None
            if call is None:
                return held, ()  # not a call after all: the model's text, as it wrote it
            calls.append(call)
        return ("", tuple(calls)) if calls else (held, ())
