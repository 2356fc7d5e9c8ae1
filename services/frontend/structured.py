"""The API's structured-output fields, turned into the request's one ``StructuredOutput``:
OpenAI's ``response_format`` and vLLM's ``structured_outputs`` and older ``guided_*``
extras. At most one of them per request; a spec that does not compile is a 400 naming the
problem here, at the edge, before anything is allocated for the request."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict

from services.api.structured import StructuredKind, StructuredOutput, check
from services.common.errors import InvalidRequest

Str = Annotated[str, Strict()]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class JsonSchemaFormat(_Body):
    name: Str = Field(min_length=1, max_length=64)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: Str | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsIn(_Body):
    """vLLM's ``structured_outputs``: exactly one of these."""

    json_: dict[str, Any] | Str | None = Field(None, alias="json")
    regex: Str | None = None
    choice: list[Str] | None = None
    grammar: Str | None = None
    json_object: bool | None = None


def structured_output(response_format: ResponseFormat | None, so: StructuredOutputsIn | None,
                      guided: dict[str, Any]) -> StructuredOutput | None:
    """The one constraint the request asks for (None: free text); InvalidRequest when it
    asks for several or for one that does not compile. ``guided``: the ``guided_*`` fields
    that are set, by name."""
    found: list[tuple[str, StructuredOutput]] = []
    if response_format is not None and response_format.type != "text":
        if response_format.type == "json_object":
            found.append(("response_format", StructuredOutput(StructuredKind.JSON_OBJECT)))
        else:
            js = response_format.json_schema
            if js is None or js.schema_ is None:
                raise InvalidRequest("response_format: json_schema needs json_schema.schema",
                                     param="response_format", code="invalid_value")
            found.append(("response_format", _from_kind("json", js.schema_, "response_format")))
    if so is not None:
        given = {k: v for k, v in (("json", so.json_), ("regex", so.regex),
                                   ("choice", so.choice), ("grammar", so.grammar),
                                   ("json_object", so.json_object or None))
                 if v is not None}
        if len(given) != 1:
            raise InvalidRequest("structured_outputs: give exactly one of json, regex, "
                                 "choice, grammar, json_object", param="structured_outputs",
                                 code="invalid_value")
        (k, v), = given.items()
        found.append(("structured_outputs", _from_kind(k, v, "structured_outputs")))
    for name, v in guided.items():
        found.append((name, _from_kind(name.removeprefix("guided_"), v, name)))
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(n for n, _ in found)
        raise InvalidRequest(f"{names}: give at most one structured-output constraint",
                             param=found[1][0], code="invalid_value")
    param, spec = found[0]
    try:
        check(spec)
    except ValueError as e:
        raise InvalidRequest(str(e).replace("structured_outputs", param, 1), param=param,
                             code="invalid_value") from None
    return spec


def _from_kind(kind: str, value: Any, param: str) -> StructuredOutput:
    """The spec of one field; InvalidRequest naming ``param`` for a bad shape."""
    try:
        if kind == "json":
            if isinstance(value, str):
                return StructuredOutput(StructuredKind.JSON_SCHEMA, value)
            return StructuredOutput.json_schema(value)
        if kind == "json_object":
            return StructuredOutput(StructuredKind.JSON_OBJECT)
        if kind == "regex":
            return StructuredOutput(StructuredKind.REGEX, value)
        if kind == "choice":
            return StructuredOutput(StructuredKind.CHOICE, choices=tuple(value))
        return StructuredOutput(StructuredKind.GRAMMAR, value)
    except ValueError as e:
        raise InvalidRequest(str(e).replace("structured_outputs", param, 1), param=param,
                             code="invalid_value") from None
