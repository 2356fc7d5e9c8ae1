"""What a decode or prefill worker wires up when its runner is tensor-parallel: the TP
metrics, and a rank's death as the cue to stop (deregister, fail what is in flight so the
processor migrates it, exit non-zero)."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry

from services.common.service import PartFailed
from services.engine.runner.base import ModelRunner
from services.engine.tp.runner import TpRunner


def attach(runner: ModelRunner, registry: CollectorRegistry, stop: asyncio.Event) -> None:
    if not isinstance(runner, TpRunner):
        return
    from services.engine.tp.metrics import TpCollector

    registry.register(TpCollector(runner))
    loop = asyncio.get_running_loop()
    runner.on_rank_death = lambda _why: loop.call_soon_threadsafe(stop.set)


def close(runner: ModelRunner) -> None:
    """Stop the ranks; raise if one had failed, so the worker exits non-zero."""
    runner.close()
    if isinstance(runner, TpRunner) and runner.num_failures:
        raise PartFailed(f"worker stopped: {runner.failure}")
