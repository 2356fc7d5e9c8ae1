"""`tandem processor -c FILE [--set k=v] [--replica N]`: one processor replica.

Loads only the tokenizer, finds routers in discovery (or at ``processor.router_address``),
serves gRPC on ``processor.port + N`` and /metrics on ``processor.metrics_port + N``,
registers as role "processor". SIGTERM/SIGINT: deregister, let in-flight streams finish
(up to ``processor.drain_timeout_s``), exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging

from prometheus_client import start_http_server

from services.common.address_book import AddressBook, ChannelPool
from services.common.config import ClusterConfig
from services.common.discovery import Discovery, Registration
from services.common.nats_client import connect
from services.common.net import advertised_host
from services.common.service import run_part, stop_on_signals

log = logging.getLogger("tandem.processor")


async def serve(cfg: ClusterConfig, replica: int = 0, host: str | None = None) -> None:
    host = cfg.bind_host if host is None else host
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

    model_path = resolve_model_path(cfg.model.path)
    tok = Tokenizer.from_path(model_path)
    images = ImagePrompting.for_model(model_path, tok.id_to_token)
    ctx = context_length(cfg, model_path)
    name = cfg.model.name or served_model_name(cfg.model.path)
    pc = cfg.processor
    nc = await connect(cfg.nats, name=f"processor-{replica}")
    pool = ChannelPool()
    routers = AddressBook("router", pc.router_address)
    try:
        disc = await Discovery.open(nc, cfg.namespace, cfg.discovery)
        if pc.router_address is None:
            routers.start(disc)
        metrics = ProcessorMetrics()
        processor = Processor(tok, RouterClient(routers, pool), DecodeWorkerClient(pool), name,
                              ctx, cfg.engine.block_size, metrics, pc.migration_limit,
                              publish_reports=inflight_publisher(nc, cfg.namespace), instance=f"processor-{replica}",
                              images=images)
        # before the port opens: a part that looks ready must stop cleanly (see stop_on_signals)
        stop = stop_on_signals()
        server, port = await serve_processor(processor, host, pc.port + replica)
        metrics_port = pc.metrics_port + replica
        start_http_server(metrics_port, registry=metrics.registry, addr=host)
        adv = advertised_host(host)
        lease = await disc.register(Registration(
            "processor", f"processor-{replica}", address=f"{adv}:{port}",
            metrics_address=f"{adv}:{metrics_port}", metadata={"model": name}))
        log.info("processor %d: model %s (context %d), gRPC on %d, metrics on %d",
                 replica, name, ctx, port, metrics_port)
        await stop.wait()
        log.info("processor %d: draining", replica)
        await lease.close()
        await server.stop(grace=pc.drain_timeout_s)
        with contextlib.suppress(Exception):  # the router expires what is left by TTL
            await asyncio.wait_for(nc.flush(), 2.0)
    finally:
        await routers.close()
        await pool.close()
        await nc.close()


def main(args: argparse.Namespace) -> int:
    return run_part(args, serve)
