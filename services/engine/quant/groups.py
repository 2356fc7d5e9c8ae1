"""Group-wise 4-bit weights in the form torch's int4 kernels take, from GGUF blocks or floats.

torch's weight-only int4 matmul (``_weight_int4pack_mm``, CPU and CUDA) dequantizes each
group of ``group_size`` input columns of an output row as ``w = (q - 8) * scale + zero``
with ``q`` in 0..15. GGUF's 32-wide blocks map onto that without rounding anything but
the scales (fp16 in the file, the activation dtype in the kernel):

- Q4_0: ``w = d * (q - 8)``                    -> scale d, zero 0
- Q4_1: ``w = d * q + m = d * (q - 8) + (m + 8d)`` -> scale d, zero m + 8d
- Q8_0: ``w = d * q`` with q in -128..127. Split ``q = 16 * hi + lo`` (hi = q >> 4 in
  -8..7, lo = q & 15 in 0..15): ``w = 16d * ((hi + 8) - 8) + d * (lo - 8) + 8d``, two
  4-bit groups per block. The two halves sit side by side along the input dimension
  (``input_repeat = 2``): the layer feeds ``[x, x]`` and one int4 matmul sums both, so
  a Q8_0 tensor keeps its exact values at 8 bits a weight.

Anything else (F16/F32, K-quants, Hugging Face weights) is quantized from float:
asymmetric min/max per group of ``FLOAT_GROUP_SIZE``, one rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch
from gguf import GGMLQuantizationType

Q = GGMLQuantizationType
BLOCK = 32  # GGUF's Q4_0 / Q4_1 / Q8_0 block width
FLOAT_GROUP_SIZE = 32  # divides every hidden size we run (576 = 18 * 32); 64/128 do not
# GGUF types whose blocks map onto int4 groups exactly, and the bits each stores a weight.
EXACT_TYPES = {Q.Q4_0: 4, Q.Q4_1: 4, Q.Q8_0: 8}
FOUR_BIT_TYPES = frozenset({Q.Q4_0, Q.Q4_1, Q.Q4_K})


@dataclass(frozen=True)
class Int4Groups:
    """A ``[out, in]`` weight as 4-bit codes plus a float scale and zero per group.

    ``codes`` uint8 (out, in * input_repeat), values 0..15; ``scale``/``zero`` float32
    (out, in * input_repeat / group_size); the weight of row n, column k (summed over the
    repeats) is ``sum_r (codes[n, r*in + k] - 8) * scale[n, g] + zero[n, g]``.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    group_size: int
    input_repeat: int = 1
    bits: int = 4  # what the source stored a weight in (8 for Q8_0): decides `auto`

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def in_features(self) -> int:
        return self.codes.shape[1] // self.input_repeat

    def dequantize(self) -> torch.Tensor:
        """The float32 weight (out, in) these groups stand for."""
        n, k = self.codes.shape
        q = self.codes.float().view(n, k // self.group_size, self.group_size) - 8
        w = (q * self.scale.unsqueeze(-1) + self.zero.unsqueeze(-1)).view(n, k)
        return w.view(n, self.input_repeat, self.in_features).sum(1)

    def rows(self, start: int, stop: int) -> Int4Groups:
        """Output rows ``start:stop``."""
        return self.map_rows(lambda t: t[start:stop])

    def cols(self, start: int, stop: int) -> Int4Groups:
        """Input columns ``start:stop`` (of every repeat), which must be whole groups."""
        gs = self.group_size
        if start % gs or stop % gs:
            raise ValueError(f"input columns {start}:{stop} are not whole int4 groups of {gs}")
        n, r, k = self.out_features, self.input_repeat, self.in_features

        def cut(t: torch.Tensor, width: int, lo: int, hi: int) -> torch.Tensor:
            return t.reshape(n, r, width)[:, :, lo:hi].reshape(n, r * (hi - lo)).contiguous()

        return Int4Groups(cut(self.codes, k, start, stop), cut(self.scale, k // gs, start // gs, stop // gs),
                          cut(self.zero, k // gs, start // gs, stop // gs), gs, r, self.bits)

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Int4Groups:
        """The same groups with ``fn`` (a row permutation, e.g. GGUF's rotary un-permute)
        applied to every per-row tensor."""
        return Int4Groups(fn(self.codes), fn(self.scale), fn(self.zero), self.group_size,
                          self.input_repeat, self.bits)


@dataclass(frozen=True)
class QuantSource:
    """What a weights file offers the quantizer: the exact int4 groups of its Q4_0 / Q4_1 /
    Q8_0 tensors (HF names, rows in HF order) and whether its linears are 4-bit."""

    groups: Mapping[str, Int4Groups] = field(default_factory=dict)
    four_bit: bool = False


def same_layout(parts: list[Int4Groups]) -> bool:
    """Whether ``parts`` can be stacked by ``cat_rows`` (same input, grouping and repeat)."""
    return len({(p.group_size, p.input_repeat, p.in_features) for p in parts}) == 1


def cat_rows(parts: list[Int4Groups]) -> Int4Groups:
    """Stack the outputs of several weights over the same input (q/k/v, gate/up)."""
    if not same_layout(parts):
        raise ValueError("cannot fuse int4 weights with different group layouts")
    first = parts[0]
    return Int4Groups(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]),
                      torch.cat([p.zero for p in parts]), first.group_size, first.input_repeat,
                      max(p.bits for p in parts))


def from_gguf_blocks(data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, int]) -> Int4Groups:
    """The exact int4 groups of a Q4_0 / Q4_1 / Q8_0 tensor; ``data`` its raw bytes, ``shape``
    the torch shape (out, in)."""
    n, k = shape
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(n, k // BLOCK, -1)  # (N, G, block bytes)
    d = raw[..., :2].copy().view(np.float16).astype(np.float32)[..., 0]  # (N, G)
    if qtype == Q.Q8_0:
        q = raw[..., 2:].view(np.int8).astype(np.int16)  # (N, G, 32) in -128..127
        hi, lo = (q >> 4) + 8, q & 15
        codes = np.concatenate([hi.reshape(n, k), lo.reshape(n, k)], axis=1)  # (N, 2K)
        scale = np.concatenate([16 * d, d], axis=1)
        zero = np.concatenate([np.zeros_like(d), 8 * d], axis=1)
        return _groups(codes, scale, zero, input_repeat=2, bits=8)
    if qtype == Q.Q4_0:
        zero, qs = np.zeros_like(d), raw[..., 2:]
    elif qtype == Q.Q4_1:
        m, qs = raw[..., 2:4].copy().view(np.float16).astype(np.float32)[..., 0], raw[..., 4:]
        zero = m + 8 * d
    else:
        raise ValueError(f"no exact int4 form for GGUF type {qtype.name}")
    # 16 bytes a block: low nibbles are elements 0..15, high nibbles 16..31.
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, k)
    return _groups(codes, d, zero, input_repeat=1, bits=4)


def _groups(codes: np.ndarray, scale: np.ndarray, zero: np.ndarray, *, input_repeat: int,
            bits: int) -> Int4Groups:
    return Int4Groups(torch.from_numpy(np.ascontiguousarray(codes, dtype=np.uint8)),
                      torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32)),
                      torch.from_numpy(np.ascontiguousarray(zero, dtype=np.float32)),
                      BLOCK, input_repeat, bits)


def from_float(w: torch.Tensor, group_size: int = FLOAT_GROUP_SIZE) -> Int4Groups:
    """Asymmetric 4-bit min/max quantization of a float (out, in) weight, per group."""
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"in_features {k} is not a multiple of the int4 group size {group_size}")
    g = w.float().reshape(n, k // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)  # (N, G)
    scale = ((hi - lo) / 15).clamp(min=torch.finfo(torch.float32).tiny)
    q = ((g - lo.unsqueeze(-1)) / scale.unsqueeze(-1)).round().clamp(0, 15)
    return Int4Groups(q.to(torch.uint8).reshape(n, k).contiguous(), scale.contiguous(),
                      (lo + 8 * scale).contiguous(), group_size)
