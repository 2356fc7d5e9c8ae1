"""`tandem frontend -c FILE [--set k=v]`: the HTTP API on ``frontend.host:port`` (uvicorn).

Finds processors in discovery (or at ``frontend.processor_address``), watches routers and
decode workers for /health, registers as role "frontend". SIGTERM/SIGINT: deregister, stop
accepting, let in-flight requests finish (up to ``frontend.drain_timeout_s``), exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
from typing import Any

import uvicorn

from services.common.address_book import AddressBook, ChannelPool
from services.common.config import ClusterConfig, FrontendConfig
from services.common.discovery import Discovery, Registration
from services.common.nats_client import connect
from services.common.net import advertised_host
from services.common.service import run_part

log = logging.getLogger("tandem.frontend")


class _Server(uvicorn.Server):
    # NOTE: uvicorn re-raises a captured SIGTERM after shutdown (exit by signal); we handle
    # the signals ourselves so a drain ends with exit status 0.
    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[override]
        yield


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


async def serve(cfg: ClusterConfig, replica: int = 0) -> None:
    from services.frontend.app import create_app
    from services.frontend.readiness import ClusterReadiness
    from services.processor.client import ProcessorClient

    fc = cfg.frontend
    nc = await connect(cfg.nats, name=f"frontend-{replica}")
    pool = ChannelPool()
    processors = AddressBook("processor", fc.processor_address)
    routers, decoders = AddressBook("router"), AddressBook("decode")
    try:
        disc = await Discovery.open(nc, cfg.namespace, cfg.discovery)
        for book in (processors, routers, decoders):
            if not book.addresses():  # a fixed address needs no watch
                book.start(disc)
        app = create_app(cfg, ProcessorClient(processors, pool),
                         ClusterReadiness(routers, decoders, processors))
        port = fc.port + replica
        server = _Server(http_config(app, fc, port))
        adv = advertised_host(fc.host)
        lease = await disc.register(Registration(
            "frontend", f"frontend-{replica}", address=f"{adv}:{port}",
            metrics_address=f"{adv}:{port}"))

        loop = asyncio.get_running_loop()
        closing: list[asyncio.Task[None]] = []

        def on_signal() -> None:
            # Deregister first (so nothing new is sent here), then let uvicorn stop accepting
            # and finish in-flight requests for up to frontend.drain_timeout_s.
            if not closing:
                closing.append(loop.create_task(lease.close()))
            server.should_exit = True

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        log.info("frontend: http://%s:%d/v1", fc.host, port)
        try:
            await server.serve()
        finally:
            await lease.close()
    finally:
        for book in (processors, routers, decoders):
            await book.close()
        await pool.close()
        await nc.close()


def main(args: argparse.Namespace) -> int:
    return run_part(args, serve)
