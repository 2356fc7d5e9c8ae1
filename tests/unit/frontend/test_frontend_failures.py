"""Errors the client did not cause, and routes that do not exist, in OpenAI's shape: an
unexpected exception is one log line (request id, type, message, no traceback) and a 500
counted in the metrics; a failed part's message (addresses) stays in the log; 404/405."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

import httpx
import pytest

from services.common.errors import ServingError
from tests.support.http_edge import Echo, Failing, chat, error, frontend_lines, metric, stub_api
from tests.support.mock_cluster import MODEL


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with stub_api(Echo()) as client:
        yield client


# ---- routes -----------------------------------------------------------------------------
async def test_unknown_path_is_openai_404(http: httpx.AsyncClient) -> None:
    err = error(await http.post("/v1/chat/complete", json=chat()), 404)
    assert err["message"] == "Invalid URL (POST /v1/chat/complete)"
    assert (await http.get("/")).status_code == 404


async def test_wrong_method_is_openai_405(http: httpx.AsyncClient) -> None:
    r = await http.get("/v1/chat/completions")
    assert error(r, 405)["message"] == "Invalid method for URL (GET /v1/chat/completions)"
    assert r.headers["allow"] == "POST"
    error(await http.delete("/v1/models"), 405)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/models"])
async def test_unexpected_exception_is_an_openai_500_logged_once_and_counted(
        caplog: pytest.LogCaptureFixture, path: str) -> None:
    caplog.set_level(logging.INFO)
    async with stub_api(Failing(KeyError("boom"))) as c:
        r = await (c.post(path, json=chat()) if path.startswith("/v1/chat") else c.get(path))
        err = error(r, 500)
        assert err["type"] == "internal_error" and "boom" not in err["message"]
        assert await metric(c, "500") == 1.0
    (line,) = frontend_lines(caplog)
    rid = err["message"].rsplit("request id ", 1)[1].rstrip(")")
    assert line.levelno == logging.ERROR and line.exc_info is None
    assert rid in line.getMessage() and "KeyError: 'boom'" in line.getMessage()
    assert not [x for x in caplog.records if x.exc_info]  # no traceback anywhere


async def test_exception_mid_stream_is_an_error_event_counted_500(
        caplog: pytest.LogCaptureFixture) -> None:
    async with stub_api(Failing(RuntimeError("kaput"), before=2)) as c:
        r = await c.post("/v1/chat/completions", json=chat(stream=True))
        assert r.status_code == 200  # the stream had started
        events = [e[6:] for e in r.text.split("\n\n") if e.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["type"] == "internal_error"
        assert await metric(c, "500") == 1.0 and await metric(c, "499") == 0.0
    (line,) = frontend_lines(caplog)
    assert "RuntimeError: kaput" in line.getMessage() and line.exc_info is None


async def test_exception_mid_responses_stream_is_an_error_and_a_failed_response(
        caplog: pytest.LogCaptureFixture) -> None:
    async with stub_api(Failing(RuntimeError("kaput"), before=2)) as c:
        r = await c.post("/v1/responses", json={"model": MODEL, "input": "Hi!", "stream": True})
        assert r.status_code == 200  # the stream had started
        events = [json.loads(e.split("data: ", 1)[1]) for e in r.text.split("\n\n") if "data: " in e]
        assert [e["type"] for e in events] == [
            "response.created", "response.in_progress", "response.output_item.added",
            "response.content_part.added", "response.output_text.delta",
            "response.output_text.delta", "error", "response.failed"]
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert events[-2]["code"] == "internal_error" and "kaput" not in events[-2]["message"]
        failed = events[-1]["response"]
        assert failed["status"] == "failed" and failed["error"]["code"] == "internal_error"
        assert "[DONE]" not in r.text
        assert await metric(c, "500") == 1.0 and await metric(c, "499") == 0.0
    (line,) = frontend_lines(caplog)
    assert "RuntimeError: kaput" in line.getMessage() and line.exc_info is None


async def test_internal_serving_error_names_no_address(caplog: pytest.LogCaptureFixture) -> None:
    """A part that crashed reaches us as ServingError("processor 10.0.0.7:9100 failed: ..."):
    the client gets the fixed sentence and the request id, the log the detail."""
    detail = "processor 10.0.0.7:9100 failed: UNKNOWN: Unexpected <class 'TypeError'>"
    async with stub_api(Failing(ServingError(detail))) as c:
        for stream in (False, True):
            err = error(await c.post("/v1/chat/completions", json=chat(stream=stream)), 500)
            assert "10.0.0.7" not in err["message"] and "request id" in err["message"]
    lines = frontend_lines(caplog)
    assert len(lines) == 2 and all(detail in x.getMessage() for x in lines)


