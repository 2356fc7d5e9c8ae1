"""Which slice of the model one tensor-parallel rank holds.

Query heads and the MLP's intermediate dimension split evenly across ranks. KV heads
split the same way while there are at least as many as ranks; with more ranks than KV
heads, each KV head is replicated on ``tp_size / num_kv_heads`` consecutive ranks (as
vLLM does), so every rank holds exactly one.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.model.arch import ModelArchConfig


@dataclass(frozen=True, slots=True)
class TpShard:
    rank: int = 0
    size: int = 1

    def kv_replicas(self, num_kv_heads: int) -> int:
        """How many ranks hold each KV head (1 unless there are more ranks than KV heads)."""
        return self.size // num_kv_heads if self.size > num_kv_heads else 1

    def local_kv_heads(self, num_kv_heads: int) -> int:
        return max(1, num_kv_heads // self.size)

    def kv_head_start(self, num_kv_heads: int) -> int:
        """The first (global) KV head this rank holds."""
        return (self.rank // self.kv_replicas(num_kv_heads)) * self.local_kv_heads(num_kv_heads)

    def holds_kv_primary(self, num_kv_heads: int) -> bool:
        """Whether this rank is the first holder of its KV heads (the one that exports them)."""
        return self.rank % self.kv_replicas(num_kv_heads) == 0


def check_tp_layout(arch: ModelArchConfig, tp_size: int) -> None:
    """Raise ValueError when ``arch`` cannot be split ``tp_size`` ways, naming what does not divide."""
    if tp_size < 1:
        raise ValueError(f"engine.tensor_parallel_size must be >= 1, got {tp_size}")
    problems = []
    if arch.num_heads % tp_size:
        problems.append(f"{arch.num_heads} attention heads")
    if arch.intermediate_size % tp_size:
        problems.append(f"intermediate size {arch.intermediate_size}")
    kv = arch.num_kv_heads
    if (kv >= tp_size and kv % tp_size) or (kv < tp_size and tp_size % kv):
        problems.append(f"{kv} KV heads (need a divisor or a multiple of them)")
    if problems:
        raise ValueError(
            f"engine.tensor_parallel_size={tp_size} does not divide the model's "
            + ", ".join(problems))
