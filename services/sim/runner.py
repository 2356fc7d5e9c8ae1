"""The simulator's model runner: no model and no KV tensor, only the time a batch takes.

Every sampled token is ``SimRunner.token`` (never an end of sequence), so a request
generates exactly its ``max_tokens``. Exported KV is a ``KvStub`` with the shape and dtype
an import checks: the scheduler's remote-prefill path runs unchanged, and the transfer's
bytes are costed by the simulator from ``sim.kv_bytes_per_token``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.common.config import EngineConfig
from services.engine.batch import RunnerOutput, ScheduledBatch, batch_shape
from services.engine.runner.base import KvSpec, ModelRunner, RunnerInfo
from services.steptime.model import BatchShape, StepModel

# Clear of the special tokens at the bottom of a vocabulary (and of the mock's eos).
SIM_TOKEN = 1000


@dataclass(frozen=True, slots=True)
class KvStub:
    """Stands for exported KV blocks: what ``remote_kv_problem`` checks, and no data."""

    shape: tuple[int, ...]
    dtype: torch.dtype


class SimRunner(ModelRunner):
    """Sized by ``engine.num_kv_blocks`` / ``block_size``; vocabulary and context length from
    ``engine.mock`` (``engine.max_model_len`` caps the latter), as the mock runner's."""

    info = RunnerInfo(device="sim")

    def __init__(self, cfg: EngineConfig, model: StepModel, token: int = SIM_TOKEN) -> None:
        self.kv_spec = KvSpec(1, cfg.num_kv_blocks, cfg.block_size, 1, 1, torch.float32)
        self.vocab_size = cfg.mock.vocab_size
        self.max_model_len = cfg.max_model_len or cfg.mock.context_length
        if not 0 <= token < self.vocab_size:
            raise ValueError(f"sim token {token} is outside the vocabulary [0, {self.vocab_size})")
        self.token = token
        self.model = model
        self.last_seconds = 0.0  # what the last executed batch takes on the modelled device
        self.last_shape = BatchShape()  # and its shape

    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        tok = self.token
        sampled: list[int | None] = [tok if s.sample else None for s in batch.seqs]
        shape = self.last_shape = batch_shape(batch)
        self.last_seconds = self.model.step_seconds(shape)
        self.busy_seconds += self.last_seconds
        return RunnerOutput(sampled)

    def export_kv(self, block_ids: Sequence[int]) -> KvStub:  # type: ignore[override]
        return KvStub(self.kv_spec.block_range_shape(len(block_ids)), self.kv_spec.dtype)

    def import_kv(self, block_ids: Sequence[int], data: object) -> None:
        expected = self.kv_spec.block_range_shape(len(block_ids))
        shape = getattr(data, "shape", None)
        if shape is None or tuple(shape) != expected:
            raise ValueError(f"kv shape {shape} != expected {expected}")
