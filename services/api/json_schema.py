"""The JSON schema a grammar is built from, as OpenAI's strict mode, xgrammar and
llama.cpp read a client's schema: closed objects and bounded free values.

- **Closed objects.** An object schema that lists ``properties`` (or
  ``patternProperties``) and says nothing of ``additionalProperties`` (nor
  ``unevaluatedProperties``) allows no other keys. JSON Schema's own default is to allow
  any, but pydantic's and langchain's ``bind_tools`` schemas never say so, and a small
  model then invents keys (``{"city": "Paris", "type": "string"}``) that break ``fn(**args)``.
  A schema that wants extra keys says ``additionalProperties: true`` (or a schema).
  NOTE: schemas that apply to one object together are left open where each lists only
  its share of the properties (closing one would refuse the others' keys): the members of
  an ``allOf``, the members of an ``anyOf``/``oneOf`` beside ``properties``, and a schema
  whose ``allOf``/``anyOf``/``oneOf`` members list properties.
- **Bounded free values.** A value the schema leaves free (``{}``, ``true``, a bare
  ``{"type": "object"}`` or ``"array"``, ``additionalProperties: true``) nests at most
  ``MAX_FREE_DEPTH`` arrays or objects deep, so a grammar cannot keep a model opening
  objects until its request times out. Strings and recursive ``$ref`` schemas can still run
  long: ``max_tokens`` bounds those (a forced tool call has a default, tools.py).
"""

from __future__ import annotations

from typing import Any

MAX_FREE_DEPTH = 4

# Keywords whose value is one subschema, a list of them, or a map of names to them.
# NOTE: not, if, then, else and dependentSchemas are left as written: they constrain a value
# together with their parent, which closing them alone would change.
_ONE = ("additionalProperties", "items", "contains", "propertyNames", "unevaluatedItems",
        "unevaluatedProperties", "additionalItems")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_COMBINED = ("allOf", "anyOf", "oneOf")
_MAP = ("properties", "patternProperties", "$defs", "definitions")
# Keywords that say nothing of a value: a schema with only these leaves it free.
_NOTES = frozenset(("title", "description", "default", "examples", "$comment", "deprecated",
                    "readOnly", "writeOnly", "$schema", "$id", "nullable"))
_SCALARS = ["null", "boolean", "number", "string"]


def free_value(depth: int = MAX_FREE_DEPTH) -> dict[str, Any]:
    """Any JSON value with at most ``depth`` levels of arrays and objects."""
    if depth <= 0:
        return {"type": list(_SCALARS)}
    inner = free_value(depth - 1)
    return {"anyOf": [{"type": list(_SCALARS)}, {"type": "array", "items": inner},
                      {"type": "object", "additionalProperties": inner}]}


def for_grammar(schema: Any) -> Any:
    """``schema`` with its objects closed and its free values bounded (see the module
    docstring); a new value, ``schema`` is not changed."""
    return _walk(schema, shared=False)


def canonical(schema: Any, names: bool = False) -> Any:
    """``schema`` with its keywords sorted, so schemas that differ only in keyword order
    are one grammar. NOTE: the names in ``properties`` keep their order: it is the order
    the model writes them in (OpenAI's strict mode too), the caller's choice (a reasoning
    field before the answer)."""
    if isinstance(schema, list):
        return [canonical(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    if names:
        return {k: canonical(v) for k, v in schema.items()}
    return {k: canonical(schema[k], names=k == "properties") for k in sorted(schema)}


def _types(s: dict[str, Any]) -> set[str]:
    t = s.get("type")
    return {t} if isinstance(t, str) else set(t) if isinstance(t, list) else set()


def _lists_keys(s: Any) -> bool:
    return isinstance(s, dict) and ("properties" in s or "patternProperties" in s)


def _walk(s: Any, shared: bool) -> Any:
    """``shared``: ``s`` applies to its object together with a sibling that lists
    properties too, so it is not closed."""
    if s is True:
        return free_value()
    if not isinstance(s, dict):
        return s
    if not shared and s.keys() <= _NOTES:
        return {**s, **free_value()}
    lists_keys = _lists_keys(s)
    out: dict[str, Any] = {}
    for k, v in s.items():
        if k in _ONE:
            out[k] = v if isinstance(v, bool) and k != "items" else _walk(v, False)
        elif k in _LIST and isinstance(v, list):
            out[k] = [_walk(x, k == "allOf" or (k in _COMBINED and lists_keys)) for x in v]
        elif k in _MAP and isinstance(v, dict):
            out[k] = {name: _walk(x, False) for name, x in v.items()}
        else:
            out[k] = v
    members = [x for k in _COMBINED if isinstance(s.get(k), list) for x in s[k]]
    if shared or any(_lists_keys(x) for x in members):
        return out
    open_keys = ("additionalProperties", "unevaluatedProperties")
    if not any(k in s for k in open_keys):
        if lists_keys:
            out["additionalProperties"] = False
        elif "object" in _types(s):
            out["additionalProperties"] = free_value(MAX_FREE_DEPTH - 1)
    elif s.get("additionalProperties") is True:
        out["additionalProperties"] = free_value(MAX_FREE_DEPTH - 1)
    if "array" in _types(s) and "items" not in s and "prefixItems" not in s:
        out["items"] = free_value(MAX_FREE_DEPTH - 1)
    return out
