"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from fastapi.responses import JSONResponse

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

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def from_serving_error(e: ServingError, retry_after_s: int) -> APIError:
    """The HTTP answer for a serving error: status, type and default code from the one
    error table (services/common/errors.py)."""
    k = kind_of(e)
    headers = {"Retry-After": str(retry_after_s)} if k.retry_after else None
    return APIError(k.http_status, e.message, k.openai_type, param=e.param or k.default_param,
                    code=e.code or k.default_code, headers=headers)
