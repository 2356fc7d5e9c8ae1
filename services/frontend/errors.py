"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import json

from fastapi import Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from services.common.errors import ServingError, kind_of


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


def from_serving_error(e: ServingError, retry_after_s: int) -> APIError:
    """The HTTP answer for a serving error: status, type and default code from the one
    error table (services/common/errors.py)."""
    k = kind_of(e)
    headers = {"Retry-After": str(retry_after_s)} if k.retry_after else None
    return APIError(k.http_status, e.message, k.openai_type, param=e.param or k.default_param,
                    code=e.code or k.default_code, headers=headers)


def internal_error(request_id: str) -> APIError:
    """The answer to an exception nobody expected (logged by whoever caught it)."""
    return APIError(500, f"the server had an error while processing the request (request id "
                    f"{request_id})", "internal_error")


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
