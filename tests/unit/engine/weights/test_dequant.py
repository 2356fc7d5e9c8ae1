"""Our chunked dequantize against gguf.quants.dequantize: the same float32 bits for every
block type the loader accepts, over one chunk and over many."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from services.engine.weights import dequant
from services.model.gguf_file import open_gguf

Q = GGMLQuantizationType


# where each block type keeps its float16 scales (bytes): random bytes there can be NaN or
# inf, which compare unequal, so the tests put finite values in them
_SCALE_BYTES = {"Q8_0": (0,), "Q4_0": (0,), "Q5_0": (0,), "Q4_1": (0, 2), "Q5_1": (0, 2),
                "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def _raw(qtype: GGMLQuantizationType, rows: int, blocks_per_row: int, seed: int) -> np.ndarray:
    _, type_size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, blocks_per_row * type_size), dtype=np.uint8)
    blocks = raw.reshape(-1, type_size)
    for at in _SCALE_BYTES[qtype.name]:
        blocks[:, at:at + 2] = rng.uniform(-2, 2, (blocks.shape[0], 1)).astype(np.float16).view(np.uint8)
    return raw


@pytest.mark.parametrize("name", list(_SCALE_BYTES))
@pytest.mark.parametrize("chunk", [1 << 22, 300])
def test_same_bits_as_gguf(name: str, chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    qtype = Q[name]
    monkeypatch.setattr(dequant, "_CHUNK_VALUES", chunk)  # 300: a chunk per row, many rows
    raw = _raw(qtype, rows=7, blocks_per_row=3, seed=5)
    want = quants.dequantize(raw, qtype)
    got = dequant.dequantize(raw, qtype)
    assert got.dtype == np.float32 and got.shape == want.shape
    assert np.array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32))


def test_the_real_models_tensors(smollm2_path: Path) -> None:
    seen = set()
    for t in open_gguf(smollm2_path).tensors:
        if t.tensor_type in seen and not t.name.startswith("token_embd"):
            continue
        seen.add(t.tensor_type)
        want = quants.dequantize(t.data, t.tensor_type)
        got = dequant.dequantize(t.data, t.tensor_type)
        assert np.array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32)), t.name
    assert Q.Q4_1 in seen
