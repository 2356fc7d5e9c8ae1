"""The model runner interface: the only bridge between the engine's plain-Python control
plane (scheduler, block pool) and the compute (torch model or the mock cost model)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.engine.batch import RunnerOutput, ScheduledBatch


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


class ModelRunner(ABC):
    """Computes scheduled batches against a paged KV cache it owns.

    Contract: ``execute`` writes the KV of every scheduled token into the blocks named by
    the sequence's block table and returns one sampled token per sequence with
    ``sample=True``. Block ids are the scheduler's; the runner never allocates or frees.
    """

    kv_spec: KvSpec
    vocab_size: int
    max_model_len: int

    @abstractmethod
    def execute(self, batch: ScheduledBatch) -> RunnerOutput: ...

    @abstractmethod
    def export_kv(self, block_ids: Sequence[int]) -> torch.Tensor:
        """A copy of the given blocks, all layers: ``kv_spec.block_range_shape(len(block_ids))``."""

    @abstractmethod
    def import_kv(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        """Write ``data`` (as returned by ``export_kv``) into the given blocks.

        Raises ValueError when the shape or dtype does not match ``kv_spec``.
        """
