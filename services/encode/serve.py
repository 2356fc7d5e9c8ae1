"""`tandem encode -c FILE [--set k=v] [--replica N]`: one encode worker process.

Loads only the vision half of the LLaVA model (tower + projector) and serves seed 002's
encode side on ``encode.port + N`` (proto/encode.proto), /metrics on
``encode.metrics_port + N``, registered in discovery as role ``encode``. Transfers a
language side stopped resuming are freed after ``encode.stale_transfer_s``.
SIGTERM/SIGINT: deregister, finish in-flight calls for up to ``encode.grace_period_s``, exit 0
(services/common/lifecycle.py).
"""

from __future__ import annotations

import argparse
import asyncio
import logging

from services.common import lifecycle
from services.common.config import ClusterConfig
from services.common.lifecycle import GrpcListener, PartSpec, Setup
from services.common.service import run_part

log = logging.getLogger("tandem.encode")


async def _build(part: Setup) -> PartSpec:
    import torch

    from services.encode.grpc_server import serve_encode_worker
    from services.encode.metrics import encode_registry
    from services.engine.factory import is_llava_dir
    from services.engine.multimodal.blocks import EmbeddingBlockAllocator
    from services.engine.multimodal.buffers import EmbeddingBuffers
    from services.engine.multimodal.embedder import LocalEncodeChannel, VisionEncoder
    from services.engine.multimodal.placer import ShmPlacer
    from services.engine.multimodal.transfer import EmbeddingSender
    from services.engine.runner.torch_runner import resolve_device, resolve_dtype
    from services.model.store import resolve_model_path

    cfg, instance = part.cfg, part.instance
    torch.set_num_threads(cfg.engine.threads)
    model_path = resolve_model_path(cfg.model.path)
    if not is_llava_dir(model_path):
        raise ValueError(f"encode worker: the model {model_path} is not a LLaVA model (no vision tower)")
    device = resolve_device(cfg.engine.device)
    mm, ec = cfg.multimodal, cfg.encode
    dtype = resolve_dtype(cfg.engine.dtype, device, cpu_isa_setting=cfg.engine.cpu_isa)  # as the decode worker's
    encoder = VisionEncoder(model_path, device, dtype, mm.embedding_cache_entries)
    # NOTE: rows kept and sent in the model's dtype (no widening); written into a language
    # side's shared memory when it is on this host.
    sender = EmbeddingSender(EmbeddingBlockAllocator(mm.num_blocks, mm.block_size, 1),
                             EmbeddingBuffers(mm.num_blocks, mm.block_size, encoder.hidden_size, encoder.dtype),
                             encoder.encode, placer=ShmPlacer(ec.shm_mapped_bytes))
    channel = LocalEncodeChannel(sender, instance)
    part.on_close(channel.close, "embedding transfers")
    part.task(_reap(channel, ec.stale_transfer_s), "encode reaper")

    async def open_port(host: str, port: int) -> GrpcListener:
        return GrpcListener(*await serve_encode_worker(channel, host, port))

    return PartSpec(
        ec.advertise_host, ec.grace_period_s, open=open_port, port=ec.port + part.replica,
        registry=encode_registry(encoder, channel), metrics_port=ec.metrics_port + part.replica,
        metadata={"model": str(model_path.name)},
        announce=lambda b: log.info("encode worker %s: gRPC :%d, metrics :%d", instance, b.port, b.metrics_port))


async def _reap(channel, stale_after_s: float) -> None:
    while True:
        await asyncio.sleep(stale_after_s / 4)
        freed = await channel.reap(stale_after_s)
        if freed:
            log.warning("freed %d embedding transfers nobody resumed for %.0fs", len(freed), stale_after_s)


async def serve(cfg: ClusterConfig, replica: int = 0, host: str | None = None) -> None:
    await lifecycle.run(cfg, "encode", replica, _build, host=host)


def main(args: argparse.Namespace) -> int:
    return run_part(args, serve)
