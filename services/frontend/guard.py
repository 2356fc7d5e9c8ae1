"""The last line of defence (pure ASGI middleware): an exception no handler caught becomes
one log line (request id, exception type and message), an OpenAI-shaped 500 and a count in
``tandem_frontend_requests_total``; never a plain-text "Internal Server Error" with a
traceback per request, which is what Starlette and uvicorn do with it."""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.frontend.errors import internal_error
from services.frontend.metrics import FrontendMetrics

log = logging.getLogger("tandem.frontend")

REQUEST_ID = "request_id"  # the key handlers store their request id under in scope["state"]


class CatchAll:
    def __init__(self, app: ASGIApp, metrics: FrontendMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        started = False

        async def watch(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception as e:  # noqa: BLE001 - this is the place that catches everything
            rid = request_id(scope)
            log.error("request %s: %s %s failed: %s: %s", rid, scope.get("method"),
                      scope.get("path"), type(e).__name__, e)
            if started:
                # Too late for a status; the handler that started it counted the request.
                # Not re-raised: uvicorn would log the traceback again.
                return
            self.metrics.requests.labels("500").inc()
            self.metrics.duration.observe(time.perf_counter() - t0)
            await internal_error(rid).response()(scope, receive, send)


def request_id(scope: Scope) -> str:
    state: dict[str, Any] = scope.get("state") or {}
    rid = state.get(REQUEST_ID)
    return rid if isinstance(rid, str) else uuid.uuid4().hex
