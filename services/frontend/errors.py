"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

What a client reads never names the cluster's insides: an overloaded, unavailable or
failed part (429, 503, 500) is answered with a fixed sentence, and its detailed message
(a worker's address, the config key that refused it) goes to the frontend's log. The inner
parts keep raising detailed messages, for their own logs and for this one.
"""

from __future__ import annotations

import json
import logging
import time

from fastapi import Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from services.common.errors import ServingError, kind_of

log = logging.getLogger("tandem.frontend")

# By ErrorKind.kind (services/common/errors.py): what the client is told instead of the
# detailed message. Kinds not listed (bad input, unknown model) are the client's own doing
# and keep their message, which names the field.
PUBLIC_MESSAGES = {
    "overloaded": "the server is overloaded, retry later",
    "unavailable": "no worker is available, retry later",
    "internal": "the server had an error while processing the request",
}
# Refusals come in storms (every request while a worker is full): their detail is logged at
# most once per kind per this many seconds, with a count of the ones left out.
REFUSAL_LOG_INTERVAL_S = 10.0


class APIError(Exception):
    """An HTTP error the API returns as OpenAI does."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> Response:
        # NOTE: ensure_ascii: a message quoting a client's string must not be able to fail
        # its own encoding (a lone surrogate cannot be written as UTF-8).
        return Response(json.dumps(self.body(), separators=(",", ":")), status_code=self.status,
                        headers=self.headers, media_type="application/json")


class ServingErrors:
    """Renders serving errors for one app (which owns the refusal log's rate limit)."""

    def __init__(self, retry_after_s: int,
                 refusal_log_interval_s: float = REFUSAL_LOG_INTERVAL_S) -> None:
        self.retry_after_s = retry_after_s
        self._refusals = _RefusalLog(refusal_log_interval_s)

    def from_serving_error(self, e: ServingError, request_id: str) -> APIError:
        """The HTTP answer for a serving error: status, type and default code from the one
        error table (services/common/errors.py); for the kinds in PUBLIC_MESSAGES, a fixed
        message, the detailed one logged (a 500 always, a 429/503 rate-limited)."""
        k = kind_of(e)
        headers = {"Retry-After": str(self.retry_after_s)} if k.retry_after else None
        message = e.message
        public = PUBLIC_MESSAGES.get(k.kind)
        if public is not None:
            if k.kind == "internal":  # a bug somewhere: every one is worth its line
                log.error("request %s: %d %s: %s", request_id, k.http_status, k.kind, e.message)
                message = f"{public} (request id {request_id})"
            else:
                self._refusals.log(k.kind, request_id, k.http_status, e.message)
                message = public
        return APIError(k.http_status, message, k.openai_type, param=e.param or k.default_param,
                        code=e.code or k.default_code, headers=headers)


def internal_error(request_id: str) -> APIError:
    """The answer to an exception nobody expected (logged by whoever caught it)."""
    return APIError(500, f"{PUBLIC_MESSAGES['internal']} (request id {request_id})",
                    "internal_error")


async def route_error(request: Request, exc: Exception) -> Response:
    """Starlette's 404 (no such path) and 405 (path without that method) in OpenAI's shape
    and wording, instead of FastAPI's ``{"detail": ...}``."""
    assert isinstance(exc, HTTPException)
    where = f"{request.method} {request.url.path}"
    if exc.status_code == 404:
        message = f"Invalid URL ({where})"
    elif exc.status_code == 405:
        message = f"Invalid method for URL ({where})"
    else:
        message = str(exc.detail)
    return APIError(exc.status_code, message, headers=dict(exc.headers or {})).response()


class _RefusalLog:
    """One line per kind per interval; the next line counts the ones left out."""

    def __init__(self, interval_s: float) -> None:
        self._interval = interval_s
        self._next: dict[str, float] = {}
        self._skipped: dict[str, int] = {}

    def log(self, kind: str, request_id: str, status: int, detail: str) -> None:
        now = time.monotonic()
        if now < self._next.get(kind, 0.0):
            self._skipped[kind] = self._skipped.get(kind, 0) + 1
            return
        self._next[kind] = now + self._interval
        skipped = self._skipped.pop(kind, 0)
        more = f" (and {skipped} more since the last line)" if skipped else ""
        log.warning("request %s: %d %s: %s%s", request_id, status, kind, detail, more)
