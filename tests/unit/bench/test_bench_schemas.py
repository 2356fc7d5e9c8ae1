"""`tandem bench schemas`' generator: the same seed gives the same schemas, every one is a
valid JSON Schema, and together they cover the kinds the bench promises."""

from __future__ import annotations

import json

import jsonschema

from services.bench.schemas import make_schemas


def _kinds(schema: dict, seen: set[str]) -> None:
    for prop in schema["properties"].values():
        seen.add(prop.get("type", "enum"))
        if prop.get("type") == "object":
            _kinds(prop, seen)


def test_schemas_are_seeded_valid_and_varied() -> None:
    a, b = make_schemas(50, 3), make_schemas(50, 3)
    assert json.dumps(a) == json.dumps(b)
    assert json.dumps(a) != json.dumps(make_schemas(50, 4))
    seen: set[str] = set()
    for s in a:
        jsonschema.Draft202012Validator.check_schema(s)
        _kinds(s, seen)
    assert seen == {"integer", "number", "string", "boolean", "enum", "array", "object"}
    assert any(s["required"] != list(s["properties"]) for s in a)  # some optional fields
