"""The structured-output fields at the HTTP edge: each form becomes the request's one
StructuredOutput; several at once, or one that does not compile, is a 400 naming it, and
the processor is never called for it (nothing is allocated)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from services.api.outputs import FinishReason, Usage
from services.api.processor import Delta, ModelInfo, ProcessRequest
from services.api.structured import StructuredKind, StructuredOutput
from services.frontend.app import create_app
from tests.support.mock_cluster import MODEL, mock_cluster_cfg


class Recorder:
    def __init__(self) -> None:
        self.requests: list[ProcessRequest] = []

    async def generate(self, req: ProcessRequest) -> AsyncIterator[Delta]:
        self.requests.append(req)
        yield Delta("{}", FinishReason.STOP, Usage(3, 1))

    async def list_models(self) -> list[ModelInfo]:
        return [ModelInfo(MODEL, 128)]


@pytest.fixture
async def api() -> AsyncIterator[tuple[httpx.AsyncClient, Recorder]]:
    rec = Recorder()
    app = create_app(mock_cluster_cfg(), rec)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        yield c, rec


def chat(**kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **kw}


def comp(**kw) -> dict:
    return {"model": MODEL, "prompt": "Hi", **kw}


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize(("path", "body", "want"), [
    ("/v1/chat/completions", chat(response_format={"type": "json_object"}),
     StructuredOutput(StructuredKind.JSON_OBJECT)),
    ("/v1/chat/completions", chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": SCHEMA, "strict": True}}), StructuredOutput.json_schema(SCHEMA)),
    ("/v1/completions", comp(structured_outputs={"json": SCHEMA}), StructuredOutput.json_schema(SCHEMA)),
    ("/v1/completions", comp(structured_outputs={"regex": "[0-9]+"}),
     StructuredOutput(StructuredKind.REGEX, "[0-9]+")),
    ("/v1/chat/completions", chat(structured_outputs={"choice": ["a", "b"]}),
     StructuredOutput(StructuredKind.CHOICE, choices=("a", "b"))),
    ("/v1/chat/completions", chat(structured_outputs={"grammar": 'start: "x"'}),
     StructuredOutput(StructuredKind.GRAMMAR, 'start: "x"')),
    ("/v1/completions", comp(guided_json=SCHEMA), StructuredOutput.json_schema(SCHEMA)),
    ("/v1/completions", comp(guided_regex="a+"), StructuredOutput(StructuredKind.REGEX, "a+")),
    ("/v1/completions", comp(guided_choice=["y", "n"]),
     StructuredOutput(StructuredKind.CHOICE, choices=("y", "n"))),
    ("/v1/completions", comp(guided_grammar='root ::= "a"'),
     StructuredOutput(StructuredKind.GRAMMAR, 'root ::= "a"')),
    ("/v1/chat/completions", chat(response_format={"type": "text"}), None),
])
async def test_each_form_reaches_the_processor_as_one_structured_output(api, path, body, want) -> None:
    c, rec = api
    r = await c.post(path, json=body)
    assert r.status_code == 200, r.text
    assert rec.requests[-1].sampling.structured == want


@pytest.mark.parametrize(("body", "param", "text"), [
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}),
     "response_format", "Invalid type"),
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
     "response_format", "needs json_schema.schema"),
    (chat(structured_outputs={"regex": "(ab"}), "structured_outputs", "unclosed group"),
    (chat(guided_regex="[z-a]"), "guided_regex", "does not compile"),
    (chat(guided_grammar="start: nothing_here"), "guided_grammar", "unknown name"),
    (chat(structured_outputs={"regex": "a", "choice": ["b"]}), "structured_outputs", "exactly one"),
    (chat(structured_outputs={"choice": []}), "structured_outputs", "1 to 256"),
    (chat(response_format={"type": "json_object"}, guided_regex="a"), "guided_regex", "at most one"),
    (chat(response_format={"type": "xml"}), "response_format.type", ""),
])
async def test_bad_constraint_is_400_naming_it_and_nothing_starts(api, body, param, text) -> None:
    c, rec = api
    r = await c.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and text in err["message"] and err["type"] == "invalid_request_error"
    assert rec.requests == []


async def test_a_guided_json_string_that_is_not_json_is_400_naming_it(api) -> None:
    c, rec = api
    r = await c.post("/v1/completions", json=comp(guided_json="{not json"))
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "guided_json" and "not JSON" in err["message"]
    assert rec.requests == []
