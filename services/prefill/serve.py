"""`tandem prefill -c FILE [--set k=v] [--replica N]`: one prefill worker process.

Replica i serves /metrics on ``prefill.metrics_port + i`` and registers in discovery as role
``prefill`` (instance id ``prefill-{i}``). SIGTERM/SIGINT: deregister, stop pulling jobs, let
running ones finish for up to ``prefill.grace_period_s`` (unfinished ones are redelivered to
another worker by JetStream), exit 0 (services/common/lifecycle.py).
"""

from __future__ import annotations

import argparse
import logging

from services.common import lifecycle
from services.common.cache_reset import CacheResetResponder
from services.common.config import ClusterConfig
from services.common.lifecycle import Bound, PartSpec, Setup
from services.common.nats_client import Subjects
from services.common.net import advertised_host
from services.common.service import run_part
from services.disagg.kv_layout import METADATA_KEY as KV_LAYOUT
from services.disagg.kv_layout import KvLayout, refuse_incompatible_peers
from services.engine.async_engine import AsyncEngine
from services.engine.factory import build_engine
from services.engine.tp import worker_hooks as tp_hooks
from services.prefill.metrics import PrefillMetrics
from services.prefill.worker import PrefillWorker

log = logging.getLogger(__name__)


async def _build(part: Setup) -> PartSpec:
    import torch

    cfg, worker_id = part.cfg, part.instance
    torch.set_num_threads(cfg.engine.threads)
    parts = build_engine(cfg, worker_id=worker_id, prefill_worker=True)
    part.on_close(lambda: tp_hooks.close(parts.engine.runner), "TP ranks")
    ae = await part.enter(AsyncEngine(parts.engine))
    metrics = PrefillMetrics(ae.stats)
    tp_hooks.attach(parts.engine.runner, metrics.registry, part.stop)
    worker = PrefillWorker(ae, part.nc, cfg, worker_id, metrics)
    layout = KvLayout.of(ae.kv_spec, cfg.engine.tensor_parallel_size)

    async def before_register(_bound: Bound) -> None:
        await worker.start()
        resets = CacheResetResponder(part.nc, Subjects(cfg.namespace), worker_id, "prefill",
                                     ae.reset_prefix_cache, metrics.registry)
        await resets.start()
        part.on_close(resets.close, "cache reset subscription")
        await refuse_incompatible_peers(await part.discovery(), "prefill", layout)

    return PartSpec(
        advertised_host(part.host), cfg.prefill.grace_period_s, registry=metrics.registry,
        metrics_port=cfg.prefill.metrics_port + part.replica,
        metadata={"model": parts.model_name, KV_LAYOUT: layout.encode()},
        drain=lambda grace_s: worker.close(grace_s=grace_s), before_register=before_register,
        announce=lambda b: log.info("prefill worker %s: pulling jobs, metrics :%d", worker_id, b.metrics_port))


async def serve(cfg: ClusterConfig, replica: int = 0, host: str | None = None) -> None:
    await lifecycle.run(cfg, "prefill", replica, _build, host=host)


def main(args: argparse.Namespace) -> int:
    return run_part(args, serve)
