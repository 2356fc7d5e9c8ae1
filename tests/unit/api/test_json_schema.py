"""The schema a grammar is built from (services/api/json_schema.py): objects closed as
strict mode reads them, the members of an allOf left open, explicit additionalProperties
kept, free values bounded in depth, the caller's schema untouched."""

from __future__ import annotations

import copy
import json
from typing import Any

import jsonschema
import pytest
from pydantic import BaseModel

from services.api.json_schema import MAX_FREE_DEPTH, canonical, for_grammar, free_value


class Address(BaseModel):
    street: str
    city: str


class Person(BaseModel):
    name: str
    home: Address
    tags: dict[str, Any] = {}
    extra: Any = None


def valid(schema: dict, value: object) -> bool:
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return False
    return True


def test_pydantic_objects_are_closed_and_their_free_fields_bounded() -> None:
    raw = Person.model_json_schema()
    before = copy.deepcopy(raw)
    s = for_grammar(raw)
    assert raw == before  # a new value
    person = {"name": "Ada", "home": {"street": "Main", "city": "Oslo"}}
    assert valid(s, person)
    assert not valid(s, {**person, "type": "string"})
    assert not valid(s, {**person, "home": {"street": "Main", "city": "Oslo", "zip": "1"}})
    # dict[str, Any] stays open to any key, Any to any value: both as deep as the bound.
    assert valid(s, {**person, "tags": {"k": [1, {"x": None}]}, "extra": [[["deep"]]]})
    deep: object = 1
    for _ in range(MAX_FREE_DEPTH + 1):
        deep = [deep]
    assert valid(s, {**person, "extra": deep[0]}) and not valid(s, {**person, "extra": deep})


def test_explicit_additional_properties_and_all_of_members_are_kept_open() -> None:
    typed = {"type": "object", "properties": {"a": {"type": "integer"}},
             "additionalProperties": {"type": "string"}}
    assert for_grammar(typed) == typed
    both = {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                      {"properties": {"b": {"type": "integer"}}}]}
    assert valid(for_grammar(both), {"a": 1, "b": 2})
    pattern = {"type": "object", "patternProperties": {"^x_": {"type": "integer"}}}
    assert valid(for_grammar(pattern), {"x_a": 1}) and not valid(for_grammar(pattern), {"y": 1})


@pytest.mark.parametrize("schema", [True, {}, {"type": "object"}, {"type": "array"},
                                    {"description": "anything"}])
def test_free_values_nest_at_most_the_bound(schema: object) -> None:
    s = for_grammar(schema)
    assert json.dumps(s)  # plain JSON
    nested: object = 1
    for _ in range(MAX_FREE_DEPTH):
        nested = {"k": nested}
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind != "array":
        assert valid(s, nested) and not valid(s, {"k": nested})
    assert valid(free_value(0), "x") and not valid(free_value(0), [])


def test_canonical_sorts_keywords_but_keeps_the_order_of_properties() -> None:
    a = {"type": "object", "properties": {"b": {"type": "string", "maxLength": 3}, "a": {}}}
    b = {"properties": {"b": {"maxLength": 3, "type": "string"}, "a": {}}, "type": "object"}
    assert json.dumps(canonical(a)) == json.dumps(canonical(b))
    assert list(canonical(a)["properties"]) == ["b", "a"]


def test_schemas_that_share_one_object_stay_open_to_each_others_keys() -> None:
    # properties beside an anyOf whose members list more of them
    beside = {"type": "object", "properties": {"kind": {"enum": ["a", "b"]}},
              "anyOf": [{"properties": {"x": {"type": "integer"}}},
                        {"properties": {"y": {"type": "integer"}}}]}
    assert valid(for_grammar(beside), {"kind": "a", "x": 1})
    # an anyOf of whole objects: each member is closed
    alone = {"anyOf": [{"type": "object", "properties": {"x": {"type": "integer"}}},
                       {"type": "object", "properties": {"y": {"type": "string"}}}]}
    assert valid(for_grammar(alone), {"x": 1}) and not valid(for_grammar(alone), {"x": 1, "z": 2})
