"""`tandem router -c FILE [--set k=v] [--replica N]`: one router replica.

Serves gRPC on ``router.port + N`` and /metrics on ``router.metrics_port + N``, registered
in discovery as role ``router``. SIGTERM/SIGINT: deregister, let running calls end (2 s),
exit 0 (services/common/lifecycle.py).
"""

from __future__ import annotations

import argparse
import logging

from services.common import lifecycle
from services.common.config import ClusterConfig
from services.common.grpc_server import serve_grpc
from services.common.lifecycle import GrpcListener, PartSpec, Setup
from services.common.net import advertised_host
from services.common.service import run_part
from services.router.grpc_server import RouterServicer
from services.router.router import Router, tune_gc_for_index

log = logging.getLogger(__name__)

# routing calls are short: what is still running after this is cancelled
STOP_GRACE_S = 2.0


async def _build(part: Setup) -> PartSpec:
    tune_gc_for_index()
    router = Router(part.cfg, replica=part.replica)
    await router.start(part.nc)
    part.on_close(router.close, "router")

    async def open_port(host: str, port: int) -> GrpcListener:
        return GrpcListener(*await serve_grpc("router", host, port, RouterServicer(router).add_to))

    rc, replica = part.cfg.router, part.replica
    return PartSpec(
        advertised_host(part.host), STOP_GRACE_S, open=open_port, port=rc.port + replica,
        registry=router.metrics.registry, metrics_port=rc.metrics_port + replica,
        announce=lambda b: log.info("router replica %d serving gRPC on %d, metrics on %d",
                                    replica, b.port, b.metrics_port))


async def serve(cfg: ClusterConfig, replica: int = 0, host: str | None = None) -> None:
    # NOTE: no_echo: the router would only drop its own in-flight updates (3 per request)
    # after receiving and decoding them.
    await lifecycle.run(cfg, "router", replica, _build, host=host, nats_no_echo=True)


def main(args: argparse.Namespace) -> int:
    return run_part(args, serve)
