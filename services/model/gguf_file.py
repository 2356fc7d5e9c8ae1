"""One parse of a GGUF file per process, shared by the weights loader, the tokenizer and the
processor.

``gguf.GGUFReader`` builds a numpy view per metadata element at open: for SmolLM2's 49k
tokens and 49k merges that is ~2 s of CPU in every part that starts, and its tokenizer
arrays then take ~0.4 s more to turn into Python lists. This reader walks the metadata
once with ``struct`` (string arrays straight into ``str``s, number arrays through one
``numpy`` view each) and maps the tensor data as ``GGUFReader`` does, so the weights loader
sees the same arrays. Little-endian GGUF v2/v3 only (what llama.cpp writes).
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

from services.model.errors import UnsupportedModelError

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
_STRING, _ARRAY = 8, 9
# GGUF value type -> struct format of one scalar (bool is a uint8 read as bool)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
          6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
# types stored element by element (the rest as bytes, shaped by quant_shape_to_byte_shape)
_PLAIN = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
          GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
          GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
          GGMLQuantizationType.I64: np.int64}


@dataclass(frozen=True)
class GgufTensor:
    name: str
    tensor_type: GGMLQuantizationType
    dims: tuple[int, ...]  # GGUF order: the fastest-varying first (torch's shape reversed)
    # read-only view of the mapped file: typed elements for F16/F32/..., else raw bytes
    # shaped (rows..., bytes per row), as gguf.GGUFReader gives them
    data: np.ndarray

    @property
    def shape(self) -> tuple[int, ...]:
        """torch's (row-major) shape."""
        return tuple(reversed(self.dims))


@dataclass(frozen=True)
class GgufFile:
    path: Path
    metadata: dict[str, Any]  # every key/value, as plain Python values (arrays as lists)
    tensors: list[GgufTensor]


class _Cursor:
    def __init__(self, buf: memoryview, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def unpack(self, fmt: str) -> Any:
        try:
            (v,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        except struct.error:
            raise UnsupportedModelError(f"{self.path}: GGUF header truncated at byte {self.pos}") from None
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.unpack("Q")
        end = self.pos + n
        if end > len(self.buf):
            raise UnsupportedModelError(f"{self.path}: GGUF string past the end at byte {self.pos}")
        s = str(self.buf[self.pos:end], "utf-8")
        self.pos = end
        return s

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            return self.array()
        fmt = _SCALARS.get(vtype)
        if fmt is None:
            raise UnsupportedModelError(f"{self.path}: unknown GGUF value type {vtype} at byte {self.pos}")
        return self.unpack(fmt)

    def array(self) -> list[Any]:
        etype, n = self.unpack("I"), self.unpack("Q")
        if etype == _STRING:
            unpack, buf, pos = struct.Struct("<Q").unpack_from, self.buf, self.pos
            out = []
            for _ in range(n):
                (k,) = unpack(buf, pos)
                pos += 8
                out.append(str(buf[pos:pos + k], "utf-8"))
                pos += k
            self.pos = pos
            return out
        np_type = _NUMPY.get(etype)
        if np_type is None:  # arrays of arrays: rare, element by element
            return [self.value(etype) for _ in range(n)]
        dt = np.dtype(np_type).newbyteorder("<")
        values = np.frombuffer(self.buf, dtype=dt, count=n, offset=self.pos)
        self.pos += n * dt.itemsize
        return values.tolist()


def read_gguf(path: Path) -> GgufFile:
    """Parse ``path``'s metadata and tensor index; the tensor data stays in a read-only map."""
    mapped = np.memmap(path, mode="r")
    cur = _Cursor(memoryview(mapped), path)
    if bytes(cur.buf[:4]) != _MAGIC:
        raise UnsupportedModelError(f"{path} is not a GGUF file (no GGUF magic)")
    cur.pos = 4
    version = cur.unpack("I")
    if version not in (2, 3):
        raise UnsupportedModelError(
            f"{path}: GGUF version {version} is not supported (2 and 3, little-endian)")
    n_tensors, n_kv = cur.unpack("Q"), cur.unpack("Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.unpack("I"))
    index = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.unpack("I")
        dims = tuple(cur.unpack("Q") for _ in range(n_dims))
        index.append((name, dims, cur.unpack("I"), cur.unpack("Q")))
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    start = cur.pos + (-cur.pos) % alignment
    tensors = []
    seen: set[str] = set()
    for name, dims, raw_type, offset in index:
        if name in seen:
            raise UnsupportedModelError(f"{path}: tensor {name!r} appears twice")
        seen.add(name)
        try:
            qtype = GGMLQuantizationType(raw_type)
        except ValueError:
            raise UnsupportedModelError(f"{path}: tensor {name!r} has unknown type {raw_type}") from None
        n_elems = int(np.prod(dims, dtype=np.int64))
        block, type_size = GGML_QUANT_SIZES[qtype]
        n_bytes = n_elems * type_size // block
        np_dims = tuple(reversed(dims))
        first = start + offset
        if first + n_bytes > len(mapped):
            raise UnsupportedModelError(f"{path}: tensor {name!r} runs past the end of the file")
        raw = mapped[first:first + n_bytes]
        plain = _PLAIN.get(qtype)
        data = (raw.view(plain).reshape(np_dims) if plain is not None
                else raw.reshape(quant_shape_to_byte_shape(np_dims, qtype)))
        tensors.append(GgufTensor(name, qtype, dims, data))
    return GgufFile(path, metadata, tensors)


@functools.lru_cache(maxsize=2)
def _open(path: Path, mtime_ns: int) -> GgufFile:
    return read_gguf(path)


def open_gguf(path: str | Path) -> GgufFile:
    """A (cached) parse of ``path``; a file rewritten in place is read anew."""
    p = Path(path).resolve()
    return _open(p, p.stat().st_mtime_ns)
