"""Int4 groups (quant/groups.py) in decode.cpp's layouts.

Output rows go in tiles of 16, one per vector lane, so the kernels' dot products never
need a horizontal sum. Per tile and 32-wide input group, 256 bytes of codes in one of two
orders (isa.py says which set reads which):

- ``pairs`` (AVX512-BF16): 16 input pairs x 16 bytes; byte i of pair p holds row i's
  inputs 2p (low nibble) and 2p + 1 (high nibble), the word pairs ``vdpbf16ps``
  multiplies with one broadcast pair of inputs;
- ``quads`` (the int8 paths): 4 chunks x 16 rows x 4 bytes; byte b of row i in chunk j
  holds row i's input 4j + b (low nibble) and 16 + 4j + b (high nibble): one AND or
  shift makes each row's 32-bit lane 4 codes, ``vpdpbusd``'s operand.

and then 16 float16 scales and 16 float16 mins, with ``w = scale * q + min`` (torch's
``(q - 8) * scale + zero``, the ``- 8 * scale`` folded in once, at load).

Float16 holds GGUF's Q4_0/Q4_1/Q8_0 scales exactly (they are float16 in the file); the
eager bfloat16 path rounds them to bfloat16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.engine.quant.groups import Int4Groups

GROUP = 32
TILE = 16
LAYOUTS = ("pairs", "quads")


def supports(groups: Int4Groups) -> bool:
    return groups.group_size == GROUP and groups.codes.shape[1] % GROUP == 0


def pack(groups: Int4Groups, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes (tiles, groups * 256) uint8, scale_min (tiles, groups, 2, 16) float16)``."""
    if not supports(groups):
        raise ValueError(f"the CPU int4 kernel needs groups of {GROUP}, got {groups.group_size}")
    if layout not in LAYOUTS:
        raise ValueError(f"code layout {layout!r} is not one of {LAYOUTS}")
    n, kw = groups.codes.shape
    g, pad = kw // GROUP, -n % TILE
    tiles = (n + pad) // TILE
    q = F.pad(groups.codes.to(torch.uint8), (0, 0, 0, pad))
    if layout == "pairs":
        q = q.view(tiles, TILE, g, GROUP // 2, 2)
        pairs = q[..., 0] | (q[..., 1] << 4)  # (tiles, row, group, pair)
        codes = pairs.permute(0, 2, 3, 1).reshape(tiles, g * 256).contiguous()
    else:
        q = q.view(tiles, TILE, g, 2, 4, 4)  # (tiles, row, group, half, chunk, byte)
        quads = q[:, :, :, 0] | (q[:, :, :, 1] << 4)  # (tiles, row, group, chunk, byte)
        codes = quads.permute(0, 2, 3, 1, 4).reshape(tiles, g * 256).contiguous()
    scale = groups.scale.float()
    mins = groups.zero.float() - 8 * scale
    sm = torch.stack([F.pad(t, (0, 0, 0, pad)).view(tiles, TILE, g) for t in (scale, mins)], dim=2)  # (tiles, 16, 2, g)
    return codes, sm.permute(0, 3, 2, 1).to(torch.float16).contiguous()
