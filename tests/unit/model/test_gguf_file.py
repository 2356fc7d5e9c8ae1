"""Our GGUF reader against gguf's own GGUFReader: the same metadata values, the same tensor
index and the same data views, on the real model and on a file with every value kind."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

from services.model.errors import UnsupportedModelError
from services.model.gguf_file import read_gguf

Q = GGMLQuantizationType


def _assert_same(path: Path) -> None:
    ref = GGUFReader(path)
    got = read_gguf(path)
    want = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert got.metadata.keys() == want.keys()
    for k, v in want.items():
        assert got.metadata[k] == v and type(got.metadata[k]) is type(v), k
    assert [t.name for t in got.tensors] == [t.name for t in ref.tensors]
    for g, r in zip(got.tensors, ref.tensors, strict=True):
        assert g.tensor_type == r.tensor_type and g.dims == tuple(r.shape.tolist()), g.name
        assert g.shape == tuple(reversed(r.shape.tolist()))
        assert g.data.dtype == r.data.dtype and g.data.shape == r.data.shape, g.name
        assert np.array_equal(g.data, r.data), g.name


def test_real_model_reads_as_gguf_reads_it(smollm2_path: Path) -> None:
    _assert_same(smollm2_path)
    meta = read_gguf(smollm2_path).metadata
    assert len(meta["tokenizer.ggml.tokens"]) == len(meta["tokenizer.ggml.token_type"]) == 49152


def test_every_value_kind_and_tensor_type(tmp_path: Path) -> None:
    path = tmp_path / "kinds.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -7)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 1e-5)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**40))
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ✓")
    w.add_array("t.strs", ["a", "", "ünï", "x y"])
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, 1.5])
    w.add_custom_alignment(64)
    rng = np.random.default_rng(0)
    w.add_tensor("a", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("b", rng.standard_normal((2, 64)).astype(np.float16))
    w.add_tensor("c", rng.integers(0, 255, (4, 18), dtype=np.uint8), raw_dtype=Q.Q4_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _assert_same(path)
    meta = read_gguf(path).metadata
    assert meta["t.strs"] == ["a", "", "ünï", "x y"] and meta["t.u64"] == 2**63 + 5
    assert meta["general.alignment"] == 64


def test_not_a_gguf_file_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "weights.gguf"
    bad.write_bytes(b"PK\x03\x04" + bytes(64))
    with pytest.raises(UnsupportedModelError, match="not a GGUF file"):
        read_gguf(bad)
    short = tmp_path / "short.gguf"
    short.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (1).to_bytes(8, "little"))
    with pytest.raises(UnsupportedModelError, match="truncated"):
        read_gguf(short)
