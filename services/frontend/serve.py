"""`tandem frontend -c FILE [--set k=v]`: the HTTP API on ``frontend.host:port`` (uvicorn).

Finds processors in discovery (or at ``frontend.processor_address``), watches routers and
decode workers for /health (and prefill workers, which /reset_prefix_cache waits for),
registers as role "frontend". SIGTERM/SIGINT: deregister, stop accepting, let in-flight
requests finish (up to ``frontend.drain_timeout_s``), exit 0 (services/common/lifecycle.py).
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Awaitable

from services.common import lifecycle
from services.common.address_book import AddressBook, ChannelPool
from services.common.cache_reset import CacheResetResult, reset_prefix_caches
from services.common.config import ClusterConfig
from services.common.lifecycle import PartSpec, Setup
from services.common.nats_client import Subjects
from services.common.net import advertised_host
from services.common.service import run_part
from services.frontend.http_server import HttpListener, Server, http_config

log = logging.getLogger("tandem.frontend")


async def _build(part: Setup) -> PartSpec:
    from services.frontend.app import create_app
    from services.frontend.readiness import ClusterReadiness
    from services.processor.client import ProcessorClient

    fc = part.cfg.frontend
    pool = ChannelPool()
    part.on_close(pool.close, "channels")
    processors = AddressBook("processor", fc.processor_address)
    routers, decoders, prefills = AddressBook("router"), AddressBook("decode"), AddressBook("prefill")
    for book in (processors, routers, decoders, prefills):
        part.on_close(book.close, f"{book.role} address book")
        if not book.addresses():  # a fixed address needs no watch
            book.start(await part.discovery())
    subjects = Subjects(part.cfg.namespace)

    def reset_caches() -> Awaitable[CacheResetResult]:
        workers = [*decoders.instances, *prefills.instances]
        return reset_prefix_caches(part.nc, subjects, workers, fc.cache_reset_timeout_s)

    app = create_app(part.cfg, ProcessorClient(processors, pool),
                     ClusterReadiness(routers, decoders, processors), reset_caches=reset_caches)

    async def open_port(_host: str, port: int) -> HttpListener:
        return await HttpListener(Server(http_config(app, fc, port)), port).start()

    # /metrics is served on the API port (no metrics_port)
    return PartSpec(
        advertised_host(fc.host), fc.drain_timeout_s, open=open_port, port=fc.port + part.replica,
        announce=lambda b: log.info("frontend: http://%s:%d/v1", fc.host, b.port))


async def serve(cfg: ClusterConfig, replica: int = 0) -> None:
    await lifecycle.run(cfg, "frontend", replica, _build, host=cfg.frontend.host)


def main(args: argparse.Namespace) -> int:
    return run_part(args, serve)
