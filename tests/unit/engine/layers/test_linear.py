"""Tensor-parallel linear layers: the shards of all ranks recompose the full layer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.engine.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
)

g = torch.Generator().manual_seed(0)
X = torch.randn(5, 8, generator=g)


def test_column_shards_concatenate_to_the_full_output():
    w, b = torch.randn(12, 8, generator=g), torch.randn(12, generator=g)
    outs = []
    for rank in range(3):
        layer = ColumnParallelLinear(8, 12, bias=True, tp_rank=rank, tp_size=3)
        layer.load(w, b)
        outs.append(layer(X))
    assert torch.allclose(torch.cat(outs, dim=-1), F.linear(X, w, b), atol=1e-6)


def test_merged_shards_hold_each_part_of_each_rank():
    q, k, v = (torch.randn(n, 8, generator=g) for n in (8, 4, 4))
    for rank in range(2):
        layer = MergedColumnParallelLinear(8, [8, 4, 4], tp_rank=rank, tp_size=2)
        for i, w in enumerate((q, k, v)):
            layer.load_part(i, w)
        got_q, got_k, got_v = layer.split_output(layer(X))
        assert torch.allclose(got_q, F.linear(X, q[rank * 4 : rank * 4 + 4]), atol=1e-6)
        assert torch.allclose(got_k, F.linear(X, k[rank * 2 : rank * 2 + 2]), atol=1e-6)
        assert torch.allclose(got_v, F.linear(X, v[rank * 2 : rank * 2 + 2]), atol=1e-6)


def test_row_partial_sums_add_up_to_the_full_output():
    w = torch.randn(6, 8, generator=g)
    partial = torch.zeros(5, 6)
    for rank in range(2):
        layer = RowParallelLinear(8, 6, tp_rank=rank, tp_size=2)
        layer.load(w)
        # What each rank computes before the all-reduce, on its half of the input.
        partial += F.linear(X[:, rank * 4 : rank * 4 + 4], layer.weight)
    assert torch.allclose(partial, F.linear(X, w), atol=1e-5)


def test_bad_shapes_and_splits_are_named():
    with pytest.raises(ValueError, match="out_features"):
        ColumnParallelLinear(8, 10, tp_size=3)
    layer = ColumnParallelLinear(8, 12)
    with pytest.raises(ValueError, match="my.weight.*shape"):
        layer.load(torch.zeros(12, 9), name="my.weight")
    with pytest.raises(ValueError, match="missing bias"):
        ColumnParallelLinear(8, 12, bias=True).load(torch.zeros(12, 8))
