"""`tandem bench schemas --base-url URL --model M`: JSON-schema answers of a running server
over many varied schemas, each parsed and validated with ``jsonschema``.

The schemas are generated from a seed (``--seed``): objects of 1-4 fields drawn from bounded
integers and numbers, short strings, booleans, enums, arrays with item and length bounds,
and nested objects, with all or some fields required. Each goes as
``response_format: {"type": "json_schema", ...}`` to ``/v1/chat/completions`` (greedy); an
answer counts as valid when it parses and validates against its schema. Needs the dev
extra's ``jsonschema``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random

import httpx

from services.bench.results import finish, header, write_json

_WORDS = ("name", "city", "colour", "size", "score", "count", "label", "level", "owner", "kind",
          "price", "year", "code", "flag", "note", "speed", "rank", "tag", "mood", "step")
_ENUMS = (["red", "green", "blue"], ["cat", "dog", "fish"], ["low", "mid", "high"], ["yes", "no"],
          ["north", "south", "east", "west"])


def _field(rng: random.Random, depth: int) -> dict:
    kinds = ["int", "number", "string", "bool", "enum", "array"] + (["object"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "int":
        lo = rng.randint(-100, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(1, 200)}
    if kind == "number":
        lo = rng.randint(-10, 10)
        return {"type": "number", "minimum": lo, "maximum": lo + rng.randint(1, 100)}
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(4, 20)}
    if kind == "bool":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": list(rng.choice(_ENUMS))}
    if kind == "array":
        lo = rng.randint(0, 2)
        item = rng.choice([{"type": "integer", "minimum": 0, "maximum": 9}, {"enum": ["a", "b", "c"]},
                           {"type": "string", "maxLength": 8}])
        return {"type": "array", "items": item, "minItems": lo, "maxItems": lo + rng.randint(0, 2)}
    return _object(rng, depth + 1)


def _object(rng: random.Random, depth: int) -> dict:
    names = rng.sample(_WORDS, rng.randint(1, 4 if depth == 0 else 2))
    props = {n: _field(rng, depth) for n in names}
    required = names if rng.random() < 0.7 else names[: max(1, len(names) // 2)]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def make_schemas(n: int, seed: int) -> list[dict]:
    """``n`` varied object schemas, the same for the same seed."""
    rng = random.Random(seed)
    return [_object(rng, 0) for _ in range(n)]


async def _one(client: httpx.AsyncClient, model: str, i: int, schema: dict, max_tokens: int) -> dict:
    body = {"model": model, "temperature": 0, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": f"Describe item {i} as JSON with the fields "
                          f"{', '.join(schema['properties'])}."}],
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": f"item{i}", "schema": schema, "strict": True}}}
    r = await client.post("/v1/chat/completions", json=body)
    if r.status_code != 200:
        return {"i": i, "ok": False, "error": f"HTTP {r.status_code}: {r.text[:200]}"}
    choice = r.json()["choices"][0]
    text = choice["message"]["content"] or ""
    import jsonschema  # NOTE: dev extra; imported here so `tandem bench --help` needs no dev deps

    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError) as e:
        return {"i": i, "ok": False, "finish_reason": choice["finish_reason"], "text": text[:200],
                "error": str(e).splitlines()[0][:200]}
    return {"i": i, "ok": True, "finish_reason": choice["finish_reason"]}


async def _run(base_url: str, model: str, schemas: list[dict], concurrency: int, max_tokens: int) -> list[dict]:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        async def go(i: int, s: dict) -> dict:
            async with sem:
                return await _one(client, model, i, s, max_tokens)
        return list(await asyncio.gather(*(go(i, s) for i, s in enumerate(schemas))))


def main(args: argparse.Namespace) -> int:
    if args.n < 1 or args.concurrency < 1:
        raise SystemExit("--n and --concurrency must be >= 1")
    head = header(args)
    schemas = make_schemas(args.n, args.seed)
    answers = asyncio.run(_run(args.base_url.rstrip("/"), args.model, schemas, args.concurrency,
                               args.max_tokens))
    bad = [a for a in answers if not a["ok"]]
    result = finish(head, {"schemas": len(schemas), "valid": len(schemas) - len(bad), "invalid": bad,
                           "seed": args.seed, "max_tokens": args.max_tokens})
    print(f"{result['valid']}/{len(schemas)} answers parse and validate against their schema")
    for b in bad:
        print(f"  schema {b['i']}: {b['error']}")
    write_json(args.json_path, result)
    return 0 if not bad else 1
