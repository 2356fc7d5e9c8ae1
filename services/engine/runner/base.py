"""The model runner interface: the only bridge between the engine's plain-Python control
plane (scheduler, block pool) and the compute (torch model or the mock cost model)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.engine.batch import DoneOutput, PendingOutput, RunnerOutput, ScheduledBatch
from services.engine.request import GenerateRequest


@dataclass(frozen=True, slots=True)
class KvSpec:
    """Shape of the paged KV cache: ``(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)``."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def block_range_shape(self, n: int) -> tuple[int, ...]:
        """Shape of ``n`` exported blocks: (layers, 2, n, block_size, kv_heads, head_dim)."""
        return (self.num_layers, 2, n, self.block_size, self.num_kv_heads, self.head_dim)


@dataclass(frozen=True, slots=True)
class RunnerInfo:
    """What computes a runner's steps: the labels of the workers' ``tandem_worker_engine_info``."""

    device: str = "none"
    dtype: str = "none"
    quantization: str = "none"
    cpu_isa: str = "none"  # the instruction set of our CPU kernels that runs (none: torch's kernels)


class ModelRunner(ABC):
    """Computes scheduled batches against a paged KV cache it owns.

    Contract: ``execute`` writes the KV of every scheduled token into the blocks named by
    the sequence's block table and returns one sampled token per sequence with
    ``sample=True``. Block ids are the scheduler's; the runner never allocates or frees.

    Overlap (``supports_overlap``): ``launch`` starts a batch and returns at once; batches
    run in launch order. A launched batch may hold placeholder tokens (``batch.placeholder``)
    for tokens the previous batch samples; the runner resolves them from its future-token
    map right before the forward (no host round trip) and writes its own samples to slots
    ``future_base + k`` of that map.
    """

    kv_spec: KvSpec
    vocab_size: int
    max_model_len: int
    supports_overlap: bool = False
    # Whether overlapping pays on this runner (what engine.overlap "auto" follows).
    overlap_pays: bool = False
    # Whether it samples from logits and honours ``batch.grammar_mask`` (structured output).
    supports_grammar: bool = False
    # Whether host buffers it reads (grammar masks) are best pinned (a CUDA device).
    pins_host_memory: bool = False
    # Seconds the runner (the device) spent computing batches: the bench's bubble is the
    # rest of the wall time.
    busy_seconds: float = 0.0
    # What computes the steps (the workers' tandem_worker_engine_info labels).
    info: RunnerInfo = RunnerInfo()
    # The most prefill tokens a step runs as per-token rows on a kernel of its own cost (the
    # CPU one-call step), up to which ``runs_as_rows`` may say yes; 0: no such path.
    row_step_tokens: int = 0

    @abstractmethod
    def execute(self, batch: ScheduledBatch) -> RunnerOutput: ...

    def runs_as_rows(self, batch: ScheduledBatch) -> bool:
        """Whether ``batch``, holding prefill, runs on the ``row_step_tokens`` path (the ITL
        target measures those steps' speed apart from the eager forward's)."""
        return False

    def launch(self, batch: ScheduledBatch) -> PendingOutput:
        """Start ``batch``; its result is read with ``result()``. Default: synchronous."""
        return DoneOutput(self.execute(batch))

    def request_added(self, request: GenerateRequest) -> None:
        """A request entered the engine (tensor parallelism broadcasts its payload here)."""
        return None

    def request_gone(self, request_id: str) -> None:
        """A request finished or was aborted; it is in no later batch."""
        return None

    def close(self) -> None:
        """Release what outlives the object (tensor parallelism: the rank processes)."""
        return None

    def reserve_future_slots(self, n: int) -> None:
        """Size the future-token map (the engine calls it once, before any launch)."""
        return None

    @abstractmethod
    def export_kv(self, block_ids: Sequence[int]) -> torch.Tensor:
        """A copy of the given blocks, all layers: ``kv_spec.block_range_shape(len(block_ids))``."""

    @abstractmethod
    def import_kv(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        """Write ``data`` (as returned by ``export_kv``) into the given blocks.

        Raises ValueError when the shape or dtype does not match ``kv_spec``.
        """
