"""A request body from the socket to a JSON value, or the 4xx that says why not.

In order: the declared media type (415), the declared and the actual size (413), a deadline
on the whole body (408), strict UTF-8, a bound on nesting depth, then ``json.loads``
without NaN/Infinity (400). The depth is checked on the bytes before parsing: Python's
parser recurses once per level, so a body nested 10,000 deep would end in RecursionError
rather than a clean answer.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from starlette.requests import ClientDisconnect

from services.frontend.errors import APIError

# The deepest nesting a body may have. An OpenAI request needs about 5 levels
# (messages[].content[].text); 64 leaves room for deep JSON-schema fields we ignore.
MAX_JSON_DEPTH = 64

# A JSON string (skipped) or one bracket. Unrolled so a long string is one C-level match.
_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')


@dataclass(frozen=True, slots=True)
class BodyLimits:
    max_bytes: int
    timeout_s: float


async def read_json(request: Request, limits: BodyLimits) -> Any:
    check_media_type(request.headers.get("content-type"))
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limits.max_bytes:
        raise too_large(limits.max_bytes)
    body = bytearray()
    # NOTE: uvicorn bounds neither how long a body may take nor a client that sends less
    # than its Content-Length; without this a slow client holds its request forever.
    try:
        async with asyncio.timeout(limits.timeout_s):
            async for chunk in request.stream():
                body += chunk
                if len(body) > limits.max_bytes:
                    raise too_large(limits.max_bytes)
    except ClientDisconnect:
        raise APIError(499, "the client disconnected") from None  # counted, not logged as a bug
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {limits.timeout_s:g} s "
                       "(frontend.body_timeout_s)", code="request_timeout",
                       headers={"Connection": "close"}) from None
    return parse_json(bytes(body))


def check_media_type(content_type: str | None) -> None:
    """415 unless the body is declared as JSON in UTF-8.

    A missing Content-Type is refused too: every OpenAI SDK and the documented curl line
    send one, and a browser may send a cross-site POST without preflight only if its type
    is absent or a form/text type, so requiring application/json makes any browser caller
    go through CORS (with no API keys configured, nothing else would stop it)."""
    if content_type is None:
        raise _unsupported("the request has no Content-Type; send `Content-Type: application/json`")
    media, *params = (p.strip().lower() for p in content_type.split(";"))
    if media != "application/json":
        raise _unsupported(f"Content-Type {media or '(empty)'!r} is not supported; "
                           "send `Content-Type: application/json`")
    for p in params:
        name, _, value = p.partition("=")
        if name.strip() == "charset" and value.strip().strip('"') not in ("utf-8", "utf8"):
            raise _unsupported("JSON bodies must be UTF-8 (charset=utf-8)")


def parse_json(body: bytes) -> Any:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _not_json(f"it is not UTF-8 (byte {e.start})") from None
    if too_deep(body, MAX_JSON_DEPTH):
        raise _not_json(f"it is nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        return json.loads(text, parse_constant=_no_constant)
    except ValueError as e:  # JSONDecodeError, NaN/Infinity, an integer of > 4300 digits
        raise _not_json(str(e)) from None


def too_deep(body: bytes, limit: int) -> bool:
    # Fast path: a body with fewer brackets than the limit cannot nest deeper.
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    depth = 0
    for m in _TOKEN.finditer(body):
        c = m.group()
        if c in (b"[", b"{"):
            depth += 1
            if depth > limit:
                return True
        elif c in (b"]", b"}"):
            depth -= 1
    return False


def too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than frontend.max_body_bytes ({limit} bytes)",
                    code="request_too_large", headers={"Connection": "close"})


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _not_json(why: str) -> APIError:
    return APIError(400, f"the request body is not valid JSON: {why}")


def _unsupported(message: str) -> APIError:
    return APIError(415, message, code="unsupported_media_type")
