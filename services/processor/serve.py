"""`tandem processor -c FILE [--set k=v] [--replica N]`: one processor replica.

Loads only the tokenizer, finds routers in discovery (or at ``processor.router_address``),
serves gRPC on ``processor.port + N`` and /metrics on ``processor.metrics_port + N``,
registers as role "processor". SIGTERM/SIGINT: deregister, let in-flight streams finish
(up to ``processor.drain_timeout_s``), exit 0 (services/common/lifecycle.py).
"""

from __future__ import annotations

import argparse
import logging

from services.common import lifecycle
from services.common.address_book import AddressBook, ChannelPool
from services.common.config import ClusterConfig
from services.common.lifecycle import GrpcListener, PartSpec, Setup
from services.common.net import advertised_host
from services.common.service import run_part

log = logging.getLogger("tandem.processor")


async def _build(part: Setup) -> PartSpec:
    from services.model.store import resolve_model_path, served_model_name
    from services.model.tokenizer import Tokenizer
    from services.processor.context import context_length
    from services.processor.grpc_server import serve_processor
    from services.processor.images import ImagePrompting
    from services.processor.metrics import ProcessorMetrics
    from services.processor.processor import Processor
    from services.processor.router_client import RouterClient
    from services.processor.router_reports import inflight_publisher
    from services.processor.worker_client import DecodeWorkerClient

    cfg, pc, replica = part.cfg, part.cfg.processor, part.replica
    model_path = resolve_model_path(cfg.model.path)
    tok = Tokenizer.from_path(model_path)
    images = ImagePrompting.for_model(model_path, tok.id_to_token)
    ctx = context_length(cfg, model_path)
    name = cfg.model.name or served_model_name(cfg.model.path)
    pool = ChannelPool()
    part.on_close(pool.close, "channels")
    routers = AddressBook("router", pc.router_address)
    part.on_close(routers.close, "router address book")
    if pc.router_address is None:
        routers.start(await part.discovery())
    metrics = ProcessorMetrics()
    # NOTE: the router expires by TTL what a report lost at shutdown leaves counted
    processor = Processor(tok, RouterClient(routers, pool), DecodeWorkerClient(pool), name,
                          ctx, cfg.engine.block_size, metrics, pc.migration_limit,
                          publish_reports=inflight_publisher(part.nc, cfg.namespace),
                          instance=part.instance, images=images)

    async def open_port(host: str, port: int) -> GrpcListener:
        return GrpcListener(*await serve_processor(processor, host, port))

    return PartSpec(
        advertised_host(part.host), pc.drain_timeout_s, open=open_port, port=pc.port + replica,
        registry=metrics.registry, metrics_port=pc.metrics_port + replica, metadata={"model": name},
        announce=lambda b: log.info("processor %d: model %s (context %d), gRPC on %d, metrics on %d",
                                    replica, name, ctx, b.port, b.metrics_port))


async def serve(cfg: ClusterConfig, replica: int = 0, host: str | None = None) -> None:
    await lifecycle.run(cfg, "processor", replica, _build, host=host)


def main(args: argparse.Namespace) -> int:
    return run_part(args, serve)
