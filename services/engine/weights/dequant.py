"""GGUF block types to float32 with gguf's own per-block arithmetic, over whole row chunks.

``gguf.quants.dequantize`` splits a tensor into many small row groups and dequantizes them
one by one: for SmolLM2's Q4_1 weights that bookkeeping made it ~0.9 s of every worker's
start (0.3 s now).
The arithmetic per block is cheap when numpy sees many blocks at once, so this calls the
same ``dequantize_blocks`` of each type over chunks of ~4M values, into one output array:
the same float32 values, bit for bit, at a bounded transient memory.
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

_CHUNK_VALUES = 1 << 22
# the block types whose gguf class is named after them and dequantizes a (blocks, bytes)
# array at once; the rest (F32, F16, BF16) go through gguf.quants.dequantize as they are
_BLOCK_TYPES = {t: getattr(quants, t.name) for t in (
    GGMLQuantizationType[n] for n in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"))}


def dequantize(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """``data`` as gguf's reader gives it (raw bytes shaped (rows..., bytes per row) for a
    block type) to float32 of shape (rows..., values per row)."""
    cls = _BLOCK_TYPES.get(qtype)
    if cls is None:
        return quants.dequantize(data, qtype)
    block, type_size = GGML_QUANT_SIZES[qtype]
    row_bytes = data.shape[-1]
    if row_bytes % type_size:
        raise ValueError(f"{qtype.name} rows of {row_bytes} bytes are not whole blocks")
    rows = data.reshape(-1, row_bytes)
    per_row = row_bytes // type_size * block
    out = np.empty((rows.shape[0], per_row), dtype=np.float32)
    step = max(1, _CHUNK_VALUES // per_row)
    for r in range(0, rows.shape[0], step):
        blocks = np.ascontiguousarray(rows[r:r + step]).reshape(-1, type_size)
        out[r:r + step] = cls.dequantize_blocks(blocks).reshape(-1, per_row)
    return out.reshape(*data.shape[:-1], per_row)
