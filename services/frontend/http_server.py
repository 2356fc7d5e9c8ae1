"""The frontend's HTTP server: uvicorn with the frontend's limits, run as the lifecycle's
listener (services/common/lifecycle.py)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import uvicorn

from services.common.config import FrontendConfig


class Server(uvicorn.Server):
    # NOTE: uvicorn re-raises a captured SIGTERM after shutdown (exit by signal); the
    # lifecycle handles the signals so a drain ends with exit status 0.
    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[override]
        yield


class HttpListener:
    """uvicorn serving in a task; ``stop`` is its own graceful shutdown (stop accepting,
    finish in-flight responses up to ``timeout_graceful_shutdown``)."""

    def __init__(self, server: Server, port: int) -> None:
        self.server, self.port = server, port
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> HttpListener:
        self._task = asyncio.create_task(self.server.serve(), name="uvicorn")
        while not self.server.started:
            if self._task.done():
                self._task.result()  # it could not start: raise why
                raise RuntimeError("uvicorn ended before it started")
            await asyncio.sleep(0.01)
        return self

    async def stop(self, grace_s: float) -> None:
        # NOTE: uvicorn's timeout_graceful_shutdown is the same grace (http_config)
        self.server.should_exit = True
        if self._task is not None:
            await self._task


def http_config(app: Any, fc: FrontendConfig, port: int) -> uvicorn.Config:
    """uvicorn with the frontend's read limits (docs/operations.md, "HTTP timeouts and
    limits"): headers and their size in http_protocol.py, keep-alive idle time here, the
    body in the app (body.py)."""
    from services.frontend.http_protocol import with_header_limits

    # NOTE: uvicorn types timeout_keep_alive as int but only hands it to call_later.
    return uvicorn.Config(app, host=fc.host, port=port, log_level="warning",
                          http=with_header_limits(fc.header_timeout_s, fc.keep_alive_timeout_s),
                          timeout_keep_alive=fc.keep_alive_timeout_s,  # type: ignore[arg-type]
                          timeout_graceful_shutdown=int(fc.drain_timeout_s))
