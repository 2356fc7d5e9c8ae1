"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from services.processor.types import (
    InvalidRequest,
    ModelNotFound,
    Overloaded,
    ProcessorError,
    Unavailable,
)


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


def from_processor(e: ProcessorError, retry_after_s: int) -> APIError:
    """Map the processor's typed errors to HTTP: 400, 404, 429 or 503 (+ Retry-After) or 500."""
    if isinstance(e, InvalidRequest):
        return APIError(400, e.message, param=e.param, code=e.code)
    if isinstance(e, Overloaded):
        return APIError(429, e.message, "rate_limit_error", code=e.code or "overloaded",
                        headers={"Retry-After": str(retry_after_s)})
    if isinstance(e, ModelNotFound):
        return APIError(404, e.message, param=e.param or "model", code=e.code or "model_not_found")
    if isinstance(e, Unavailable):
        return APIError(503, e.message, "service_unavailable", code=e.code or "no_workers",
                        headers={"Retry-After": str(retry_after_s)})
    return APIError(500, e.message, "internal_error", code=e.code)
