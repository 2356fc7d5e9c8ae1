"""A rank's slice of a quantized linear (tensor parallelism).

Each weight is quantized whole, as at TP=1, and then cut like its dense layer
(layers/linear.py): a column-parallel layer keeps its output rows of every part, a
row-parallel one its input columns. Row scales (int8) and groups (int4) are per output
row, so a row cut is exact; a column cut keeps the whole row's int8 scale (the ranks'
partial products then sum to the TP=1 product exactly) and must keep int4 groups whole,
which is what ``shard_parts`` checks, naming the weight that does not allow it.
"""

from __future__ import annotations

from typing import TypeVar

from torch import nn

from services.engine.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from services.engine.quant.groups import Int4Groups
from services.engine.quant.int8_rows import Int8Rows

W = TypeVar("W", Int4Groups, Int8Rows)


def reduces(layer: nn.Module | None) -> bool:
    """Whether ``layer``'s partial sums are all-reduced (row-parallel, split over ranks)."""
    return isinstance(layer, RowParallelLinear) and layer.tp_size > 1


def shard_parts(parts: list[W], layer: nn.Module | None, names: list[str]) -> list[W]:
    """This rank's slice of each whole quantized part of ``layer`` (None: replicated)."""
    if layer is None or getattr(layer, "tp_size", 1) == 1:
        return parts
    if isinstance(layer, MergedColumnParallelLinear):
        out = []
        for i, p in enumerate(parts):
            size, k = layer.shard_sizes[i], layer.shard_index[i]
            out.append(p.rows(k * size, (k + 1) * size))
        return out
    if isinstance(layer, RowParallelLinear):
        local = layer.in_features
        start = layer.tp_rank * local
        for p, name in zip(parts, names, strict=True):
            if local % p.group_size:
                raise ValueError(
                    f"engine.quantization int4 with engine.tensor_parallel_size={layer.tp_size}: "
                    f"{name} would give each rank {local} of its {layer.full_in} input columns, "
                    f"not whole int4 groups of {p.group_size} (use int8, or a size that keeps "
                    "them whole)")
        return [p.cols(start, start + local) for p in parts]
    raise TypeError(f"no tensor-parallel cut for {type(layer).__name__}")
