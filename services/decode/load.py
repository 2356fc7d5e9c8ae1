"""A decode worker's load sample for the router, from its engine's stats (published by the
worker's LoadPublisher, taken at each load tick by the simulator)."""

from __future__ import annotations

from services.api.wire import WorkerLoad
from services.engine.engine import EngineStats


def worker_load(worker_id: str, s: EngineStats, timestamp: float) -> WorkerLoad:
    return WorkerLoad(worker_id, s.kv_blocks_used, s.kv_blocks_total, s.num_running,
                      s.num_waiting, s.num_prefill_tokens_pending, timestamp,
                      s.decode_tokens_left, s.num_running_unbounded)
