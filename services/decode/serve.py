"""`tandem decode -c FILE [--set k=v] [--replica N]`: one decode worker process.

Replica i serves gRPC on ``decode.port + i`` and /metrics on ``decode.metrics_port + i``,
registers in discovery as role ``decode`` (instance id ``decode-{i}``), publishes KV events
and load for the router. SIGTERM/SIGINT: deregister, refuse new requests, then with
``decode.drain: move`` move the running requests to other decode workers (KV and all:
services/decode/move_out.py), else let them finish; either within
``decode.grace_period_s``; exit 0 (services/common/lifecycle.py).
"""

from __future__ import annotations

import argparse
import logging
import time

from services.api.wire import WorkerLoad
from services.common import lifecycle
from services.common.address_book import AddressBook
from services.common.cache_reset import CacheResetResponder
from services.common.config import ClusterConfig
from services.common.kv_publisher import KvEventPublisher
from services.common.lifecycle import Bound, GrpcListener, PartSpec, Setup
from services.common.load_publisher import LoadPublisher
from services.common.nats_client import Subjects
from services.common.service import run_part
from services.decode.grpc_server import serve_decode_worker
from services.decode.load import worker_load
from services.decode.metrics import DecodeMetrics
from services.decode.worker import DecodeWorker
from services.disagg.kv_layout import METADATA_KEY as KV_LAYOUT
from services.disagg.kv_layout import KvLayout, refuse_incompatible_peers
from services.disagg.prefill_queue import PrefillQueue
from services.encode.client import EncodeDirectory
from services.engine.async_engine import AsyncEngine
from services.engine.factory import build_embedder, build_engine, stream_interval
from services.engine.multimodal.metrics import MmBlocksCollector
from services.engine.tp import worker_hooks as tp_hooks

log = logging.getLogger(__name__)


async def _build(part: Setup) -> PartSpec:
    import torch

    cfg, worker_id, dc = part.cfg, part.instance, part.cfg.decode
    torch.set_num_threads(cfg.engine.threads)
    subjects = Subjects(cfg.namespace)
    publisher: KvEventPublisher | None = None
    parts = build_engine(cfg, worker_id=worker_id,
                         on_kv_event=lambda e: publisher.on_event(e) if publisher else None)
    runner = parts.engine.runner
    part.on_close(lambda: tp_hooks.close(runner), "TP ranks")
    ae = await part.enter(AsyncEngine(parts.engine, stream_interval(cfg.engine)))
    publisher = KvEventPublisher(part.nc, subjects, worker_id, dump=ae.dump_kv_events)
    await publisher.start()
    part.on_close(publisher.close, "KV event publisher")
    part.on_close(publisher.flush, "KV event flush")
    metrics = DecodeMetrics(ae.stats, dc.disagg)
    resets = CacheResetResponder(part.nc, subjects, worker_id, "decode", ae.reset_prefix_cache,
                                 metrics.registry)
    await resets.start()
    part.on_close(resets.close, "cache reset subscription")
    queue = await PrefillQueue.open(part.nc, subjects, cfg.prefill, dc.disagg.queue_depth_cache_s, worker_id)
    discovery = await part.discovery()
    encoders = (EncodeDirectory(AddressBook("encode"), cfg.multimodal.shm_pool_bytes)
                if cfg.encode.replicas > 0 else None)
    images = build_embedder(cfg, parts.model_path, str(getattr(runner, "device", "cpu")),
                            encoders.channels if encoders is not None else None, getattr(runner, "dtype", None))
    if images is not None:
        part.on_close(images.close, "embedder")
        metrics.registry.register(MmBlocksCollector(*images.allocators))
    if encoders is not None:
        part.on_close(encoders.close, "encode channels")
        if images is not None:
            encoders.book.start(discovery)
            part.on_close(encoders.book.close, "encode address book")
    async def has_peers() -> bool:
        return any(r.instance_id != worker_id for r in await discovery.registrations("decode"))

    worker = DecodeWorker(ae, cfg, worker_id, queue, metrics=metrics,
                          embedder=images.embedder if images is not None else None,
                          has_peers=has_peers)
    part.on_close(worker.close, "move channels")
    tp_hooks.attach(runner, metrics.registry, part.stop)
    layout = KvLayout.of(ae.kv_spec, cfg.engine.tensor_parallel_size)

    def sample() -> WorkerLoad:
        return worker_load(worker_id, ae.stats(), time.time())

    async def open_port(host: str, port: int) -> GrpcListener:
        return GrpcListener(*await serve_decode_worker(worker, host, port))

    async def before_register(bound: Bound) -> None:
        worker.kv_address = bound.address
        load = LoadPublisher(part.nc, subjects, sample)
        await load.start()
        part.on_close(load.close, "load publisher")
        await refuse_incompatible_peers(discovery, "decode", layout)

    async def drain(grace_s: float) -> None:
        if not await worker.drain(grace_s):
            log.warning("decode worker %s: %d requests still running at the end of the grace "
                        "period; cancelling them", worker_id, worker.num_inflight)

    # NOTE: peers dial what discovery says, so publish the configured reachable host
    # (a compose service name, a pod IP), not the bind address.
    return PartSpec(
        dc.advertise_host, dc.grace_period_s, open=open_port, port=dc.port + part.replica,
        registry=metrics.registry, metrics_port=dc.metrics_port + part.replica,
        metadata={"model": parts.model_name, KV_LAYOUT: layout.encode()}, drain=drain,
        before_register=before_register,
        announce=lambda b: log.info("decode worker %s: gRPC %s, metrics :%d", worker_id, b.address, b.metrics_port))


async def serve(cfg: ClusterConfig, replica: int = 0, host: str | None = None) -> None:
    await lifecycle.run(cfg, "decode", replica, _build, host=host)


def main(args: argparse.Namespace) -> int:
    count = getattr(args, "replicas_in_process", 1) or 1
    if count == 1:
        return run_part(args, serve)
    return run_part(args, lambda cfg, replica: lifecycle.run_many(cfg, "decode", replica, count, _build))
