"""`tandem prefill -c FILE [--set k=v] [--replica N]`: one prefill worker process.

Replica i serves /metrics on ``prefill.metrics_port + i`` and registers in discovery as role
``prefill`` (instance id ``prefill-{i}``). SIGTERM/SIGINT: deregister, stop pulling jobs, let
running ones finish for up to ``prefill.grace_period_s`` (unfinished ones are redelivered to
another worker by JetStream), exit 0.
"""

from __future__ import annotations

import argparse
import logging

from prometheus_client import start_http_server

from services.common.config import ClusterConfig
from services.common.discovery import Discovery, Registration
from services.common.nats_client import connect
from services.common.net import advertised_host
from services.common.service import run_part, stop_on_signals
from services.disagg.kv_layout import METADATA_KEY as KV_LAYOUT
from services.disagg.kv_layout import KvLayout, refuse_incompatible_peers
from services.engine.async_engine import AsyncEngine
from services.engine.factory import build_engine
from services.engine.tp import worker_hooks as tp_hooks
from services.prefill.metrics import PrefillMetrics
from services.prefill.worker import PrefillWorker

log = logging.getLogger(__name__)


async def serve(cfg: ClusterConfig, replica: int = 0, host: str | None = None) -> None:
    host = cfg.bind_host if host is None else host
    import torch

    torch.set_num_threads(cfg.engine.threads)
    worker_id = f"prefill-{replica}"
    nc = await connect(cfg.nats, worker_id)
    parts = build_engine(cfg, worker_id=worker_id)
    async with AsyncEngine(parts.engine) as ae:
        metrics = PrefillMetrics(ae.stats)
        metrics_port = cfg.prefill.metrics_port + replica
        # before the port opens: a part that looks ready must stop cleanly (see stop_on_signals)
        stop = stop_on_signals()
        tp_hooks.attach(parts.engine.runner, metrics.registry, stop)
        start_http_server(metrics_port, registry=metrics.registry, addr=host)
        worker = PrefillWorker(ae, nc, cfg, worker_id, metrics)
        await worker.start()
        discovery = await Discovery.open(nc, cfg.namespace, cfg.discovery)
        layout = KvLayout.of(ae.kv_spec, cfg.engine.tensor_parallel_size)
        await refuse_incompatible_peers(discovery, "prefill", layout)
        lease = await discovery.register(Registration(
            "prefill", worker_id, metrics_address=f"{advertised_host(host)}:{metrics_port}",
            metadata={"model": parts.model_name, KV_LAYOUT: layout.encode()}))
        log.info("prefill worker %s: pulling jobs, metrics :%d", worker_id, metrics_port)
        try:
            await stop.wait()
        finally:
            await lease.close()
            await worker.close(grace_s=cfg.prefill.grace_period_s)
    await nc.close()
    tp_hooks.close(parts.engine.runner)


def main(args: argparse.Namespace) -> int:
    return run_part(args, serve)
