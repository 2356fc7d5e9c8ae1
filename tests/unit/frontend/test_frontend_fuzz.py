"""Fuzzing the HTTP edge, in-process: the ASGI app calling the processor over its gRPC hop
(as deployed: the codec is where out-of-range ids and lone surrogates used to fail), the
router in-process, the REAL decode worker (mock runner) on gRPC. Whatever the request, the
answer is never a 5xx, an error is in OpenAI's shape, nothing logs a traceback, and the app
keeps serving.

Two generators: schemathesis over the frontend's own OpenAPI schema (/openapi.json; bodies
that fit it and bodies that do not, which must be refused with a 4xx), and hypothesis
splicing arbitrary JSON (lone surrogates, integers past 64 bits, NaN, deep nesting) into an
otherwise valid body, field by field, plus raw bytes. ``frontend.max_tokens_limit`` is
small so generated requests stay cheap."""

from __future__ import annotations

import json
import logging
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import negative_data_rejection
from starlette.testclient import TestClient

from services.common.address_book import AddressBook, ChannelPool
from services.common.discovery import Registration
from services.frontend.app import create_app
from services.model.store import resolve_model_path
from services.model.tokenizer import Tokenizer
from services.processor.client import ProcessorClient
from services.processor.grpc_server import serve_processor
from services.router.router import Router
from tests.support.mock_cluster import MODEL, mock_cluster_cfg
from tests.support.stack import make_processor, worker_decode_node

CFG = mock_cluster_cfg(frontend={"max_tokens_limit": 16, "max_body_bytes": 65536},
                       decode={"max_waiting_requests": 64})


class _Deferred:
    """The processor's client, built in the app's lifespan (on the loop that serves requests)."""

    target: ProcessorClient | None = None

    def generate(self, req):
        assert self.target is not None
        return self.target.generate(req)

    async def list_models(self):
        assert self.target is not None
        return await self.target.list_models()


_proc = _Deferred()
_state: dict = {}


@asynccontextmanager
async def _lifespan(app):
    tok = Tokenizer.from_path(resolve_model_path("auto"))  # the test's fixture skips without it
    pool = ChannelPool()
    async with worker_decode_node(CFG, tok) as node:
        router = Router(CFG)
        router.worker_joined(Registration("decode", "w0", address=node.address))
        server, port = await serve_processor(make_processor(CFG, tok, router, 128, pool),
                                                  "127.0.0.1", 0)
        _proc.target = ProcessorClient(AddressBook("processor", f"127.0.0.1:{port}"), pool)
        _state["node"] = node
        yield
        await server.stop(0)
    await pool.close()


APP = create_app(CFG, _proc, lifespan=_lifespan)
schema = schemathesis.openapi.from_asgi("/openapi.json", APP)


def assert_clean(status: int, text: str, caplog: pytest.LogCaptureFixture, what: Any) -> None:
    """No 5xx; a 4xx is OpenAI-shaped; no traceback and no internal error was logged."""
    assert status < 500, (what, text)
    if status >= 400:
        err = json.loads(text)["error"]
        assert set(err) == {"message", "type", "param", "code"}, (what, text)
    bad = [r for r in caplog.records
           if (r.exc_info or r.levelno >= logging.ERROR) and not _test_client_noise(r)]
    assert not bad, (what, [r.getMessage() for r in bad])


def _test_client_noise(r: logging.LogRecord) -> bool:
    """asyncio's report of a test HTTP client's task left on an event loop that an earlier
    example closed: the harness's, not the server's (a tandem task names a services/ file)."""
    return r.name == "asyncio" and "Event loop is closed" in r.getMessage() and \
        "/services/" not in r.getMessage()


@schema.parametrize()
@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_no_request_gets_a_5xx(case, smollm2_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    negative = case.meta is not None and not case.meta.generation.mode.is_positive
    if isinstance(case.body, dict) and "model" in case.body and not negative:
        # NOTE: a random model name is a 404 before anything else; name the served one so
        # generated requests reach the processor and the worker. (A body made to break the
        # schema keeps its model: the broken part may be the model.)
        case.body["model"] = MODEL
    caplog.clear()
    # negative_data_rejection: a body that breaks the schema (a string for max_tokens, a
    # float for n) must be a 4xx: strict types, nothing coerced.
    response = case.call_and_validate(checks=[not_a_server_error, negative_data_rejection])
    assert_clean(response.status_code, response.text, caplog, (case.method, case.path, case.body))


# ---- hypothesis: arbitrary JSON spliced into valid bodies --------------------------------
_SURROGATES = st.sampled_from(["\ud800", "a\udfff", "\udbff\udbff", "ok\ud83d"])
_TEXT = st.text(max_size=8) | _SURROGATES
_SCALARS = (st.none() | st.booleans() | st.integers() | st.integers(min_value=2**31, max_value=2**80)
            | st.integers(min_value=-(2**80), max_value=-1) | st.floats() | _TEXT)
_JSON = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(_TEXT, inner, max_size=4), max_leaves=12)

_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
_COMPLETION = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
_FIELDS = ["model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "stream",
           "stream_options", "presence_penalty", "logprobs", "user", "stop_token_ids",
           "ignore_eos", "unknown_extra"]


_DEEP = "\x00deep\x00"  # stands for a deep nesting, which json.dumps itself cannot write


@st.composite
def _bodies(draw: st.DrawFn) -> tuple[str, bytes]:
    chat = draw(st.booleans())
    body = json.loads(json.dumps(_CHAT if chat else _COMPLETION))
    fields = _FIELDS + (["messages", "messages.0", "messages.0.content", "messages.0.role"]
                        if chat else ["prompt", "prompt.0", "suffix", "echo"])
    field = draw(st.sampled_from(fields))
    depth = draw(st.none() | st.integers(50, 3000))
    value = _DEEP if depth else draw(_JSON | st.lists(st.integers(-(2**70), 2**70), min_size=1,
                                                       max_size=4))
    where, *rest = field.split(".")
    if not rest:
        body[where] = value
    elif field == "prompt.0":
        body["prompt"] = [value]
    else:
        target = body["messages"]
        if rest == ["0"]:
            target[0] = value
        else:
            target[0][rest[1]] = value
    if body.get("stream") is True:
        body.pop("stream_options", None)  # keep streaming answers short and valid
    path = "/v1/chat/completions" if chat else "/v1/completions"
    # ensure_ascii: surrogates go out as "\ud800" escapes; allow_nan: NaN goes out as NaN
    text = json.dumps(body)
    if depth:
        text = text.replace(json.dumps(_DEEP), "[" * depth + "1" + "]" * depth)
    return path, text.encode()


_RESPONSE = {"model": MODEL, "input": [{"role": "user", "content": "Hi"}], "max_output_tokens": 2}
_RESPONSE_FIELDS = ["model", "input", "instructions", "max_output_tokens", "temperature", "top_p",
                    "top_logprobs", "include", "stream", "tools", "tool_choice", "text", "store",
                    "reasoning", "truncation", "ignore_eos", "stop", "seed", "metadata",
                    "unknown_extra", "input.0", "input.0.content", "input.0.role", "input.0.type",
                    "input.0.call_id", "input.0.content.0"]


@st.composite
def _responses_bodies(draw: st.DrawFn) -> bytes:
    body = json.loads(json.dumps(_RESPONSE))
    field = draw(st.sampled_from(_RESPONSE_FIELDS))
    value = draw(_JSON)
    where, *rest = field.split(".")
    if not rest:
        body[where] = value
    elif rest == ["0"]:
        body["input"][0] = value
    elif rest == ["0", "content", "0"]:
        body["input"][0]["content"] = [value]
    else:
        body["input"][0][rest[1]] = value
    return json.dumps(body).encode()


_RAW = st.binary(max_size=64) | st.sampled_from([
    b"", b"{", b"[" * 5000, b'{"model": NaN}', b'{"a": 1e999999}', b"\xff\xfe{}", b"\xef\xbb\xbf{}",
    b'{"model": "' + b"9" * 5000 + b'"}', b'{"prompt": [' + b"9" * 5000 + b"]}",
])


@pytest.fixture(scope="module")
def client(smollm2_path: Path):
    with TestClient(APP, raise_server_exceptions=False) as c:
        yield c


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(_bodies())
def test_arbitrary_json_in_any_field_is_never_a_5xx(
        client: TestClient, caplog: pytest.LogCaptureFixture, req: tuple[str, bytes]) -> None:
    path, body = req
    caplog.clear()
    r = client.post(path, content=body, headers={"content-type": "application/json"})
    assert_clean(r.status_code, r.text, caplog, body[:300])


@settings(max_examples=100, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(_responses_bodies())
def test_arbitrary_json_in_any_responses_field_is_never_a_5xx(
        client: TestClient, caplog: pytest.LogCaptureFixture, body: bytes) -> None:
    caplog.clear()
    r = client.post("/v1/responses", content=body, headers={"content-type": "application/json"})
    assert_clean(r.status_code, r.text, caplog, body[:300])


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/responses"]), _RAW)
def test_arbitrary_bytes_are_never_a_5xx(client: TestClient, caplog: pytest.LogCaptureFixture,
                                         path: str, body: bytes) -> None:
    caplog.clear()
    r = client.post(path, content=body, headers={"content-type": "application/json"})
    assert_clean(r.status_code, r.text, caplog, body[:300])
    assert r.status_code in (400, 404, 413), (body[:300], r.text)
