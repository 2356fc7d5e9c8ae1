"""Weight-only quantized matmuls over torch's own kernels (or, on x86 CPUs with AVX2 or
better, our int4 kernels: cpu_kernels/), and the linear layer they serve.

- int4: ``aten._weight_int4pack_mm_for_cpu`` / ``aten._weight_int4pack_mm`` (CUDA, tinygemm)
  over ``Int4Groups`` (groups.py); the weight is packed once at load.
- int8: ``aten._weight_int8pack_mm`` over ``Int8Rows`` (int8_rows.py), symmetric per
  output channel, from float.

torchao's CPU and CUDA int4 layouts call these same ops; using them directly spares a
dependency. Activations stay in the model's dtype (the scales are cast to it).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from services.engine.cpu_kernels.isa import KernelSet
from services.engine.parallel.comm import all_reduce
from services.engine.quant import pack
from services.engine.quant.groups import Int4Groups
from services.engine.quant.int8_rows import Int8Rows


def _inner_k_tiles(k: int) -> int:
    # tinygemm packs K in tiles of 16 * inner_k_tiles; the largest that divides K is fastest.
    for tiles in (8, 4, 2):
        if k % (16 * tiles) == 0:
            return tiles
    raise ValueError(f"in_features {k} is not a multiple of 32, which CUDA int4 packing needs")


class Int4Matmul(nn.Module):
    """``x (M, in) -> x @ W.T (M, out)`` for W given as int4 groups."""

    def __init__(self, groups: Int4Groups, dtype: torch.dtype, device: torch.device,
                 kernels: KernelSet | None = None) -> None:
        super().__init__()
        self.group_size, self.repeat = groups.group_size, groups.input_repeat
        self.out_features = n = groups.out_features
        self.cpu = device.type == "cpu"
        # Our kernel (cpu_kernels/) where the caller loaded one: 32-groups, bfloat16
        # activations (float32 too on the int8 paths).
        takes_dtype = dtype == torch.bfloat16 or (dtype == torch.float32 and kernels is not None and kernels.float_input)
        self.kernels = kernels if kernels is not None and self.cpu and takes_dtype and pack.supports(groups) else None
        if self.kernels is not None:
            self._int4_linear = getattr(torch.ops, self.kernels.namespace).int4_linear
            codes, scale_min = pack.pack(groups, self.kernels.layout)
            self.register_buffer("codes", codes, persistent=False)
            self.register_buffer("scale_min", scale_min, persistent=False)
            return
        # The packers want N a multiple of 16 (CPU) / 8 (CUDA): pad with zero rows, sliced off.
        pad = -n % 16
        codes = F.pad(groups.codes, (0, 0, 0, pad), value=8)  # (N + pad, K * repeat), 0..15
        scale, zero = (F.pad(t, (0, 0, 0, pad)) for t in (groups.scale, groups.zero))
        # (K * repeat / group, N, 2): the kernels' layout, one (scale, zero) pair per group and row.
        sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()
        self.register_buffer("scale_zero", sz.to(device=device, dtype=dtype), persistent=False)
        if self.cpu:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
        else:
            if dtype != torch.bfloat16:
                raise ValueError("engine.quantization int4 on CUDA needs engine.dtype bfloat16 "
                                 f"(tinygemm's only activation dtype), not {dtype}")
            pairs = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8).to(device)  # (N, K/2)
            packed = torch.ops.aten._convert_weight_to_int4pack(pairs, _inner_k_tiles(codes.shape[1]))
        self.register_buffer("packed", packed, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:  # reads the input cyclically: no [x] * repeat copy
            return self._int4_linear(x.contiguous(), self.codes, self.scale_min, self.out_features)
        if self.repeat > 1:  # a Q8_0 weight: both nibble halves read the same input
            x = torch.cat([x] * self.repeat, dim=-1)
        if self.cpu:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group_size, self.scale_zero)
        else:
            y = torch.ops.aten._weight_int4pack_mm(x, self.packed, self.group_size, self.scale_zero)
        return y if y.shape[-1] == self.out_features else y[..., : self.out_features]


class Int8Matmul(nn.Module):
    """``x @ W.T`` with W as int8 per output channel: ``W[n] ~= q[n] * scale[n]``."""

    def __init__(self, weight: Int8Rows, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        if not _has_int8_kernel(device):
            raise ValueError(f"engine.quantization int8: this torch has no _weight_int8pack_mm for "
                             f"{device.type} (int4 has one)")
        self.out_features = weight.q.shape[0]
        self.register_buffer("q", weight.q.to(device), persistent=False)
        self.register_buffer("scale", weight.scale.to(device=device, dtype=dtype), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.q, self.scale)


@functools.cache
def _has_int8_kernel(device: torch.device) -> bool:
    # NOTE: CPU always has it; CUDA only in newer torch builds. Probe once, at load.
    x = torch.zeros(1, 32, dtype=torch.bfloat16, device=device)
    q = torch.zeros(8, 32, dtype=torch.int8, device=device)
    try:
        torch.ops.aten._weight_int8pack_mm(x, q, torch.ones(8, dtype=torch.bfloat16, device=device))
    except (NotImplementedError, RuntimeError):
        return False
    return True


class QuantizedLinear(nn.Module):
    """Stands in for one of layers/linear.py's layers: the same ``forward`` /
    ``split_output`` over a quantized matmul of this rank's slice, plus the layer's bias;
    ``reduce`` (a row-parallel layer under tensor parallelism) all-reduces the partial sums
    before the bias, as RowParallelLinear does.

    ``dense`` (optional) is the float weight for batches of more than ``dense_above_rows``
    rows: int4/int8 kernels win where the step reads the weights once for a few rows
    (decode) and lose to a dense GEMM on prefill-sized batches, where compute dominates.
    """

    def __init__(self, matmul: nn.Module, bias: torch.Tensor | None, split_sizes: Sequence[int],
                 dense: torch.Tensor | None = None, dense_above_rows: int = 0, reduce: bool = False) -> None:
        super().__init__()
        self.matmul = matmul
        self.bias = bias
        self.split_sizes = list(split_sizes)
        self.dense = dense
        self.dense_above_rows = dense_above_rows
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.reduce:
            if self.dense is not None and x.shape[0] > self.dense_above_rows:
                return F.linear(x, self.dense, self.bias)
            y = self.matmul(x)
        else:
            dense = self.dense is not None and x.shape[0] > self.dense_above_rows
            y = F.linear(x, self.dense) if dense else self.matmul(x)
            all_reduce(y)
        return y if self.bias is None else y + self.bias

    def split_output(self, y: torch.Tensor) -> list[torch.Tensor]:
        return list(y.split(self.split_sizes, dim=-1))
