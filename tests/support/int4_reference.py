"""The references our int4 kernels are checked against (tests/unit/engine/cpu_kernels):
the float64 product with the dequantized weight, and on the int8 paths the same product
with the activations rounded to int8 per 32-group as matmul_int8.h rounds them."""

from __future__ import annotations

import torch

from services.engine.quant.groups import Int4Groups


def gguf_groups(source: str, n: int, k: int, gen: torch.Generator) -> Int4Groups:
    """Random weights in GGUF's exact groupings (quant/groups.py): Q4_0 (zero 0), Q4_1 (a
    min a block), Q8_0 (two nibble halves, input_repeat 2: both read the same x)."""
    scale = torch.rand(n, k // 32, generator=gen) * 0.02 + 1e-3
    if source == "Q8_0":
        q8 = torch.randint(-128, 128, (n, k), generator=gen)
        hi, lo = (q8 >> 4) + 8, q8 & 15  # q = 16 * (hi - 8) + lo
        return Int4Groups(torch.cat([hi, lo], 1).to(torch.uint8), torch.cat([16 * scale, scale], 1),
                          torch.cat([torch.zeros_like(scale), 8 * scale], 1), 32, input_repeat=2, bits=8)
    zero = torch.zeros_like(scale) if source == "Q4_0" else torch.randn(n, k // 32, generator=gen) * 0.05 + 8 * scale
    return Int4Groups(torch.randint(0, 16, (n, k), generator=gen).to(torch.uint8), scale, zero, 32)


def weight(groups: Int4Groups) -> torch.Tensor:
    """The weight as the kernels hold it: float16 scales and mins (pack.py), float64."""
    n, k = groups.codes.shape
    scale = groups.scale.half().double()
    mins = (groups.zero.float() - 8 * groups.scale.float()).half().double()
    q = groups.codes.double().view(n, k // 32, 32)
    w = (q * scale.unsqueeze(-1) + mins.unsqueeze(-1)).view(n, k)
    return w.view(n, groups.input_repeat, groups.in_features).sum(1)


def int8_input(x: torch.Tensor) -> torch.Tensor:
    """x as matmul_int8.h sees it: per 32-group, round(x * 127 / amax) * amax / 127 (float32
    arithmetic, rounding half to even as vcvtps2dq does)."""
    xf = x.float().view(x.shape[0], -1, 32)
    amax = xf.abs().amax(-1, keepdim=True)
    # NOTE: a true division, as the kernels make it: torch's ``127.0 / amax`` is
    # ``amax.reciprocal() * 127``, an ulp off at times, which moves inputs on a rounding tie
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    return (torch.round(xf * inv).double() * (amax / 127.0).double()).view(x.shape)


def reference(x: torch.Tensor, groups: Int4Groups) -> torch.Tensor:
    return x.double() @ groups.dequantize().double().T


def check(isa: str, got: torch.Tensor, x: torch.Tensor, groups: Int4Groups) -> None:
    want = reference(x, groups)
    scale = want.abs().max().item()
    if isa != "avx512_bf16":
        same = int8_input(x) @ weight(groups).T  # the same rounding of the input, in float64
        # float32 sums of exact products: only their rounding (and a bfloat16 output) differs
        rtol = 8e-3 if got.dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(got.double(), same, rtol=rtol, atol=rtol * scale)
    # the float reference: a bfloat16 output, and on the int8 paths each input within half
    # an int8 step of its group's largest (|err| <= amax / 254, ~0.4% of it, summed at random)
    torch.testing.assert_close(got.double(), want, rtol=8e-3, atol=2e-2 * scale)
