"""Tensor-parallel-ready linear layers that load their shard from a full Hugging Face weight.

Weights follow torch/HF layout ``[out_features, in_features]``. A column-parallel layer
keeps rows ``[rank * out/tp, (rank + 1) * out/tp)`` of the full weight (its outputs are
split across ranks); a row-parallel layer keeps the matching columns of the input and
all-reduces its partial sums (services/engine/parallel/comm.py). With ``tp_size == 1`` every
layer holds the whole weight and no collective is issued.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from services.engine.parallel.comm import all_reduce


def _split(size: int, tp_size: int, what: str) -> int:
    if size % tp_size:
        raise ValueError(f"{what} ({size}) is not divisible by tp_size ({tp_size})")
    return size // tp_size


def _check_shape(name: str, got: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(got.shape) != expected:
        raise ValueError(f"{name}: expected shape {expected}, got {tuple(got.shape)}")


class _ShardedLinear(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype, device=device), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False)
            if bias
            else None
        )


class MergedColumnParallelLinear(_ShardedLinear):
    """Several column-parallel projections of the same input fused into one matmul:
    ``y = x @ W.T + b`` with W's output rows split across ranks; the output stays sharded.

    ``output_sizes`` are the full (unsharded) sizes of the parts, e.g. ``[q, k, v]`` or
    ``[gate, up]``. Each part is sharded on its own so that rank r holds rows r of every
    part, laid out ``[part0_r, part1_r, ...]``; ``split_output`` cuts the result back.

    ``replicas[i]`` > 1 splits part i into ``tp_size / replicas[i]`` shards, each held by
    that many consecutive ranks: KV heads when there are more ranks than KV heads.
    """

    def __init__(
        self,
        in_features: int,
        output_sizes: Sequence[int],
        bias: bool = False,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        replicas: Sequence[int] | None = None,
    ) -> None:
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.full_sizes = list(output_sizes)
        reps = list(replicas) if replicas is not None else [1] * len(output_sizes)
        self.shard_sizes = [
            _split(s, tp_size // r, f"out_features of part {i}")
            for i, (s, r) in enumerate(zip(output_sizes, reps, strict=True))
        ]
        self.shard_index = [tp_rank // r for r in reps]  # which shard of each part this rank holds
        self.offsets = [sum(self.shard_sizes[:i]) for i in range(len(self.shard_sizes))]
        super().__init__(in_features, sum(self.shard_sizes), bias, dtype, device)

    def load_part(
        self, part: int, weight: torch.Tensor, bias: torch.Tensor | None = None, name: str = "weight"
    ) -> None:
        """Copy this rank's shard of part ``part`` from its full ``[out_part, in]`` HF weight."""
        size = self.shard_sizes[part]
        _check_shape(name, weight, (self.full_sizes[part], self.in_features))
        shard = self.shard_index[part]
        src = slice(shard * size, (shard + 1) * size)
        dst = slice(self.offsets[part], self.offsets[part] + size)
        self.weight[dst].copy_(weight[src])
        part_bias = self.bias[dst] if self.bias is not None else None  # a view: copies land in place
        _load_bias(part_bias, bias, src, self.full_sizes[part], name)

    def split_output(self, y: torch.Tensor) -> list[torch.Tensor]:
        return list(y.split(self.shard_sizes, dim=-1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ColumnParallelLinear(MergedColumnParallelLinear):
    """A column-parallel projection on its own: the merged layer with a single part."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__(in_features, [out_features], bias, tp_rank=tp_rank, tp_size=tp_size,
                         dtype=dtype, device=device)

    def load(self, weight: torch.Tensor, bias: torch.Tensor | None = None, name: str = "weight") -> None:
        """Copy this rank's rows of the full ``[out, in]`` HF weight (and bias)."""
        self.load_part(0, weight, bias, name)


class RowParallelLinear(_ShardedLinear):
    """``y = x @ W.T + b`` with W's input columns split across ranks; sums partials across ranks.

    The input is expected already sharded (the output of a column-parallel layer). The bias
    is added once, after the reduction.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.full_in = in_features
        super().__init__(
            _split(in_features, tp_size, "in_features"), out_features, bias, dtype, device
        )

    def load(self, weight: torch.Tensor, bias: torch.Tensor | None = None, name: str = "weight") -> None:
        """Copy this rank's columns of the full ``[out, in]`` HF weight (bias is not sharded)."""
        _check_shape(name, weight, (self.out_features, self.full_in))
        cols = slice(self.tp_rank * self.in_features, (self.tp_rank + 1) * self.in_features)
        self.weight.copy_(weight[:, cols])
        _load_bias(self.bias, bias, slice(None), self.out_features, name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.tp_size > 1:
            all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y


def _load_bias(
    param: torch.Tensor | None, bias: torch.Tensor | None, rows: slice, full: int, name: str
) -> None:
    if param is None:
        if bias is not None:
            raise ValueError(f"{name}: unexpected bias for a layer built with bias=False")
        return
    if bias is None:
        raise ValueError(f"{name}: missing bias for a layer built with bias=True")
    _check_shape(name.replace("weight", "bias"), bias, (full,))
    param.copy_(bias[rows])
