"""The forward's one collective, timed: every RowParallelLinear all-reduces through here;
and the overlapped loop's broadcast of rank 0's sampled tokens (``broadcast_from_entry``).

``ALL_REDUCE`` accumulates the seconds this process spent in all-reduces (on CPU gloo runs
synchronously, so wall time is the cost; on CUDA it is only the launch). The runner reads
it per step for the ``tandem_worker_tp_all_reduce_seconds`` metric.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist


class AllReduceClock:
    __slots__ = ("seconds", "calls")

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0


ALL_REDUCE = AllReduceClock()


def all_reduce(t: torch.Tensor) -> None:
    """Sum ``t`` in place across the tensor-parallel group; raises on a dead peer or a timeout."""
    t0 = time.perf_counter()
    dist.all_reduce(t)
    ALL_REDUCE.seconds += time.perf_counter() - t0
    ALL_REDUCE.calls += 1


def broadcast_from_entry(t: torch.Tensor) -> None:
    """Rank 0's ``t`` into every rank's ``t`` (contiguous, in place); raises like ``all_reduce``."""
    dist.broadcast(t, src=0)


def init_group(rank: int, size: int, port: int, device: torch.device, timeout_s: float) -> None:
    """Join the TP group (gloo on CPU, NCCL on CUDA); ``timeout_s`` bounds every collective."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size, timeout=timedelta(seconds=timeout_s))


def destroy_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
