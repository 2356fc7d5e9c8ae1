"""`tandem frontend -c FILE [--set k=v]`: the HTTP API on ``frontend.host:port`` (uvicorn).

Finds processors in discovery (or at ``frontend.processor_address``), watches routers and
decode workers for /health, registers as role "frontend". SIGTERM/SIGINT: deregister, stop
accepting, let in-flight requests finish (up to ``frontend.drain_timeout_s``), exit 0
(services/common/lifecycle.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from typing import Any

import uvicorn

from services.common import lifecycle
from services.common.address_book import AddressBook, ChannelPool
from services.common.config import ClusterConfig, FrontendConfig
from services.common.lifecycle import PartSpec, Setup
from services.common.net import advertised_host
from services.common.service import run_part

log = logging.getLogger("tandem.frontend")


class _Server(uvicorn.Server):
    # NOTE: uvicorn re-raises a captured SIGTERM after shutdown (exit by signal); the
    # lifecycle handles the signals so a drain ends with exit status 0.
    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[override]
        yield


class HttpListener:
    """uvicorn serving in a task; ``stop`` is its own graceful shutdown (stop accepting,
    finish in-flight responses up to ``timeout_graceful_shutdown``)."""

    def __init__(self, server: _Server, port: int) -> None:
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


async def _build(part: Setup) -> PartSpec:
    from services.frontend.app import create_app
    from services.frontend.readiness import ClusterReadiness
    from services.processor.client import ProcessorClient

    fc = part.cfg.frontend
    pool = ChannelPool()
    part.on_close(pool.close, "channels")
    processors = AddressBook("processor", fc.processor_address)
    routers, decoders = AddressBook("router"), AddressBook("decode")
    for book in (processors, routers, decoders):
        part.on_close(book.close, f"{book.role} address book")
        if not book.addresses():  # a fixed address needs no watch
            book.start(await part.discovery())
    app = create_app(part.cfg, ProcessorClient(processors, pool),
                     ClusterReadiness(routers, decoders, processors))

    async def open_port(_host: str, port: int) -> HttpListener:
        return await HttpListener(_Server(http_config(app, fc, port)), port).start()

    # /metrics is served on the API port (no metrics_port)
    return PartSpec(
        advertised_host(fc.host), fc.drain_timeout_s, open=open_port, port=fc.port + part.replica,
        announce=lambda b: log.info("frontend: http://%s:%d/v1", fc.host, b.port))


async def serve(cfg: ClusterConfig, replica: int = 0) -> None:
    await lifecycle.run(cfg, "frontend", replica, _build, host=cfg.frontend.host)


def main(args: argparse.Namespace) -> int:
    return run_part(args, serve)
