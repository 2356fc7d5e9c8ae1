"""`tandem decode -c FILE [--set k=v] [--replica N]`: one decode worker process.

Replica i serves gRPC on ``decode.port + i`` and /metrics on ``decode.metrics_port + i``,
registers in discovery as role ``decode`` (instance id ``decode-{i}``), publishes KV events
and load for the router. SIGTERM/SIGINT: deregister, refuse new requests, let in-flight
ones finish for up to ``decode.grace_period_s``, exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time

from prometheus_client import start_http_server

from services.api.wire import WorkerLoad
from services.common.address_book import AddressBook
from services.common.config import ClusterConfig
from services.common.discovery import Discovery, Registration
from services.common.kv_publisher import KvEventPublisher
from services.common.load_publisher import LoadPublisher
from services.common.nats_client import Subjects, connect
from services.common.service import run_part, stop_on_signals
from services.decode.grpc_server import serve_decode_worker
from services.decode.metrics import DecodeMetrics
from services.decode.worker import DecodeWorker
from services.disagg.kv_layout import METADATA_KEY as KV_LAYOUT
from services.disagg.kv_layout import KvLayout, refuse_incompatible_peers
from services.disagg.prefill_queue import PrefillQueue
from services.encode.client import EncodeDirectory
from services.engine.async_engine import AsyncEngine
from services.engine.factory import build_embedder, build_engine
from services.engine.multimodal.metrics import MmBlocksCollector
from services.engine.tp import worker_hooks as tp_hooks

log = logging.getLogger(__name__)


async def serve(cfg: ClusterConfig, replica: int = 0, host: str | None = None,
                stop: asyncio.Event | None = None, started: asyncio.Event | None = None) -> None:
    """One decode worker until SIGTERM/SIGINT (or ``stop``, when several share a process);
    ``started`` is set once it is registered in discovery."""
    host = cfg.bind_host if host is None else host
    import torch

    torch.set_num_threads(cfg.engine.threads)
    worker_id = f"decode-{replica}"
    subjects = Subjects(cfg.namespace)
    nc = await connect(cfg.nats, worker_id)
    publisher: KvEventPublisher | None = None
    parts = build_engine(cfg, worker_id=worker_id,
                         on_kv_event=lambda e: publisher.on_event(e) if publisher else None)
    async with AsyncEngine(parts.engine) as ae:
        publisher = KvEventPublisher(nc, subjects, worker_id, dump=ae.dump_kv_events)
        await publisher.start()
        metrics = DecodeMetrics(ae.stats, cfg.decode.disagg)
        queue = await PrefillQueue.open(nc, subjects, cfg.prefill,
                                        cfg.decode.disagg.queue_depth_cache_s, worker_id)
        discovery = await Discovery.open(nc, cfg.namespace, cfg.discovery)
        encoders = EncodeDirectory(AddressBook("encode")) if cfg.encode.replicas > 0 else None
        runner = parts.engine.runner
        images = build_embedder(cfg, parts.model_path, str(getattr(runner, "device", "cpu")),
                                encoders.channels if encoders is not None else None, getattr(runner, "dtype", None))
        if images is not None:
            metrics.registry.register(MmBlocksCollector(*images.allocators))
            if encoders is not None:
                encoders.book.start(discovery)
        worker = DecodeWorker(ae, cfg, worker_id, queue, metrics=metrics,
                              embedder=images.embedder if images is not None else None)
        # before the port opens: a part that looks ready must stop cleanly (see stop_on_signals)
        stop = stop or stop_on_signals()
        tp_hooks.attach(parts.engine.runner, metrics.registry, stop)
        server, port = await serve_decode_worker(worker, host, cfg.decode.port + replica)
        # NOTE: peers dial what discovery says, so publish the configured reachable host
        # (a compose service name, a pod IP), not the bind address.
        address = f"{cfg.decode.advertise_host}:{port}"
        worker.kv_address = address
        metrics_port = cfg.decode.metrics_port + replica
        start_http_server(metrics_port, registry=metrics.registry, addr=host)

        def sample() -> WorkerLoad:
            s = ae.stats()
            return WorkerLoad(worker_id, s.kv_blocks_used, s.kv_blocks_total, s.num_running,
                              s.num_waiting, s.num_prefill_tokens_pending, time.time())

        load = LoadPublisher(nc, subjects, sample)
        await load.start()
        layout = KvLayout.of(ae.kv_spec, cfg.engine.tensor_parallel_size)
        await refuse_incompatible_peers(discovery, "decode", layout)
        lease = await discovery.register(Registration(
            "decode", worker_id, address=address,
            metrics_address=f"{cfg.decode.advertise_host}:{metrics_port}",
            metadata={"model": parts.model_name, KV_LAYOUT: layout.encode()}))
        log.info("decode worker %s: gRPC %s, metrics :%d", worker_id, address, metrics_port)
        if started is not None:
            started.set()
        try:
            await stop.wait()
            log.info("decode worker %s: draining (up to %.1fs)", worker_id, cfg.decode.grace_period_s)
        finally:
            await lease.close()
            idle = await worker.drain(cfg.decode.grace_period_s)
            if not idle:
                log.warning("decode worker %s: %d requests still running at the end of the grace "
                            "period; cancelling them", worker_id, worker.num_inflight)
            await server.stop(grace=0.5)
            await load.close()
            await publisher.flush()
            await publisher.close()
            if encoders is not None:
                await encoders.book.close()
                await encoders.close()
            if images is not None:
                images.close()
    await nc.close()
    tp_hooks.close(parts.engine.runner)


async def serve_many(cfg: ClusterConfig, first: int, count: int) -> None:
    """Replicas ``first .. first+count-1`` in one process, each a full worker (own gRPC and
    metrics port, KV publisher, discovery registration); one signal stops them all."""
    stop = stop_on_signals()
    tasks: list[asyncio.Task[None]] = []
    try:
        for i in range(count):
            # NOTE: one at a time: building an engine blocks the event loop, and with K
            # building at once the others' NATS requests time out.
            up = asyncio.Event()
            tasks.append(asyncio.create_task(serve(cfg, first + i, stop=stop, started=up)))
            waiter = asyncio.create_task(up.wait())
            await asyncio.wait([tasks[-1], waiter], return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            if tasks[-1].done():
                tasks[-1].result()  # it failed to start: raise its error
        await asyncio.gather(*tasks)
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)


def main(args: argparse.Namespace) -> int:
    count = getattr(args, "replicas_in_process", 1) or 1
    if count == 1:
        return run_part(args, serve)
    return run_part(args, lambda cfg, replica: serve_many(cfg, replica, count))
