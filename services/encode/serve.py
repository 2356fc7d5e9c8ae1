"""`tandem encode -c FILE [--set k=v] [--replica N]`: one encode worker process.

Loads only the vision half of the LLaVA model (tower + projector) and serves seed 002's
encode side on ``encode.port + N`` (proto/encode.proto), /metrics on
``encode.metrics_port + N``, registered in discovery as role ``encode``. Transfers a
language side stopped resuming are freed after ``encode.stale_transfer_s``.
SIGTERM/SIGINT: deregister, finish in-flight calls for up to ``encode.grace_period_s``, exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging

from prometheus_client import start_http_server

from services.common.config import ClusterConfig
from services.common.discovery import Discovery, Registration
from services.common.nats_client import connect
from services.common.service import cancel_and_wait, run_part, stop_on_signals

log = logging.getLogger("tandem.encode")


async def serve(cfg: ClusterConfig, replica: int = 0, host: str | None = None) -> None:
    host = cfg.bind_host if host is None else host
    import torch

    from services.encode.grpc_server import serve_encode_worker
    from services.encode.metrics import encode_registry
    from services.engine.factory import is_llava_dir
    from services.engine.multimodal.blocks import EmbeddingBlockAllocator
    from services.engine.multimodal.buffers import EmbeddingBuffers
    from services.engine.multimodal.embedder import LocalEncodeChannel, VisionEncoder
    from services.engine.multimodal.transfer import EmbeddingSender
    from services.engine.runner.torch_runner import resolve_device, resolve_dtype
    from services.model.store import resolve_model_path

    torch.set_num_threads(cfg.engine.threads)
    instance = f"encode-{replica}"
    model_path = resolve_model_path(cfg.model.path)
    if not is_llava_dir(model_path):
        raise ValueError(f"encode worker: the model {model_path} is not a LLaVA model (no vision tower)")
    device = resolve_device(cfg.engine.device)
    mm, ec = cfg.multimodal, cfg.encode
    encoder = VisionEncoder(model_path, device, resolve_dtype(cfg.engine.dtype, device), mm.embedding_cache_entries)
    sender = EmbeddingSender(EmbeddingBlockAllocator(mm.num_blocks, mm.block_size, 1),
                             EmbeddingBuffers(mm.num_blocks, mm.block_size, encoder.hidden_size), encoder.encode)
    channel = LocalEncodeChannel(sender, instance)
    nc = await connect(cfg.nats, instance)
    stop = stop_on_signals()  # before the port opens (see stop_on_signals)
    server, port = await serve_encode_worker(channel, host, ec.port + replica)
    metrics_port = ec.metrics_port + replica
    start_http_server(metrics_port, registry=encode_registry(encoder, channel), addr=host)
    reaper = asyncio.create_task(_reap(channel, ec.stale_transfer_s), name="encode reaper")
    try:
        disc = await Discovery.open(nc, cfg.namespace, cfg.discovery)
        lease = await disc.register(Registration(
            "encode", instance, address=f"{ec.advertise_host}:{port}",
            metrics_address=f"{ec.advertise_host}:{metrics_port}", metadata={"model": str(model_path.name)}))
        log.info("encode worker %s: gRPC :%d, metrics :%d", instance, port, metrics_port)
        await stop.wait()
        log.info("encode worker %s: draining", instance)
        await lease.close()
        await server.stop(grace=ec.grace_period_s)
    finally:
        await cancel_and_wait(reaper)
        channel.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(nc.close(), 2.0)


async def _reap(channel, stale_after_s: float) -> None:
    while True:
        await asyncio.sleep(stale_after_s / 4)
        freed = await channel.reap(stale_after_s)
        if freed:
            log.warning("freed %d embedding transfers nobody resumed for %.0fs", len(freed), stale_after_s)


def main(args: argparse.Namespace) -> int:
    return run_part(args, serve)
