"""What a request's output must match, as it crosses every hop: one typed value.

``StructuredOutput`` is plain data (no llguidance); ``to_grammar`` turns it into the
llguidance grammar text the compiler builds a matcher from (a JSON schema read as strict
mode does: objects closed, free values bounded; json_schema.py), and ``check`` compiles it
without a tokenizer, so a bad schema, regex or grammar is refused where a request enters
(the HTTP edge), before anything is allocated for it.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import json
from dataclasses import dataclass

from services.api.json_schema import canonical, for_grammar

# Bounds on what one request may ask the grammar compiler to build.
MAX_SPEC_CHARS = 64 * 1024
MAX_CHOICES = 256
# Compact JSON: with flexible whitespace a small model may emit newlines forever.
_JSON_OPTIONS = {"whitespace_flexible": False}


class StructuredKind(enum.StrEnum):
    JSON_OBJECT = "json_object"  # any JSON object
    JSON_SCHEMA = "json_schema"  # ``spec``: the schema, as JSON text
    REGEX = "regex"  # ``spec``: a regular expression (Rust regex syntax)
    CHOICE = "choice"  # ``choices``: exactly one of these strings
    GRAMMAR = "grammar"  # ``spec``: a Lark grammar (llguidance's dialect) or GBNF


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """The constraint on a request's generated text. The constructor checks its shape
    (sizes, a schema that is JSON); whether it compiles is ``check``'s job."""

    kind: StructuredKind
    spec: str = ""
    choices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        k = self.kind
        if len(self.spec) > MAX_SPEC_CHARS:
            raise ValueError(f"structured_outputs: the {k.value} is longer than "
                             f"{MAX_SPEC_CHARS} characters")
        if k is StructuredKind.CHOICE:
            if not 1 <= len(self.choices) <= MAX_CHOICES:
                raise ValueError(f"structured_outputs: choice needs 1 to {MAX_CHOICES} strings, "
                                 f"got {len(self.choices)}")
            if any(not c for c in self.choices):
                raise ValueError("structured_outputs: a choice is an empty string")
            if sum(len(c) for c in self.choices) > MAX_SPEC_CHARS:
                raise ValueError(f"structured_outputs: the choices are longer than "
                                 f"{MAX_SPEC_CHARS} characters")
        elif k in (StructuredKind.REGEX, StructuredKind.GRAMMAR, StructuredKind.JSON_SCHEMA):
            if not self.spec:
                raise ValueError(f"structured_outputs: the {k.value} is empty")
        if k is StructuredKind.JSON_SCHEMA:
            try:
                schema = json.loads(self.spec)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs: the JSON schema is not JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("structured_outputs: a JSON schema must be an object")

    @classmethod
    def json_schema(cls, schema: object) -> StructuredOutput:
        """From a parsed schema, as canonical text (``json_schema.canonical``: equal
        schemas share a key, properties keep their order)."""
        return cls(StructuredKind.JSON_SCHEMA, json.dumps(canonical(schema), separators=(",", ":")))

    @property
    def key(self) -> str:
        """The compiled-grammar cache key: a hash of the whole spec."""
        h = hashlib.blake2b(digest_size=16)
        for part in (self.kind.value, self.spec, *self.choices):
            h.update(part.encode("utf-8", "surrogatepass"))
            h.update(b"\0")
        return h.hexdigest()


def to_grammar(s: StructuredOutput) -> str:
    """The llguidance grammar text for ``s`` (not checked: see ``check``)."""
    from llguidance import LLMatcher

    k = s.kind
    if k is StructuredKind.JSON_SCHEMA:
        return LLMatcher.grammar_from_json_schema(for_grammar(json.loads(s.spec)),
                                                  defaults=_JSON_OPTIONS)
    if k is StructuredKind.JSON_OBJECT:
        return LLMatcher.grammar_from_json_schema(for_grammar({"type": "object"}),
                                                  defaults=_JSON_OPTIONS)
    if k is StructuredKind.REGEX:
        return LLMatcher.grammar_from_regex(s.spec)
    if k is StructuredKind.CHOICE:
        # JSON string literals are Lark string literals: any choice text is quoted exactly.
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in s.choices))
    text = s.spec
    if "::=" in text:  # GBNF (llama.cpp's EBNF), which vLLM's guided_grammar also takes
        from llguidance.gbnf_to_lark import gbnf_to_lark

        text = gbnf_to_lark(text)
    return LLMatcher.grammar_from_lark(text)


@functools.lru_cache(maxsize=512)
def _problem(s: StructuredOutput) -> str:
    from llguidance import LLMatcher

    try:
        return LLMatcher.validate_grammar(to_grammar(s))
    except (ValueError, TypeError) as e:
        return str(e) or type(e).__name__


def check(s: StructuredOutput) -> None:
    """Raise ValueError naming what does not compile in ``s`` (cached by spec)."""
    problem = _problem(s)
    if problem:
        raise ValueError(f"structured_outputs: the {s.kind.value} does not compile: "
                         f"{problem.strip()}")
