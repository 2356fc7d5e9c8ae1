"""KV tensors as bytes on the wire (DecodeWorker.KvTransfer, MoveKv): dtype names, the
KvChunk messages of one transfer, and reassembly. Torch is imported by the functions that
need it only."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from services.api.request_codec import logprob_to_pb
from services.gen import worker_pb2

if TYPE_CHECKING:
    import torch

    from services.api.outputs import TokenLogprob

# NOTE: names are torch's own (str(dtype) without "torch."), the proto's documented values.
DTYPE_NAMES = ("float32", "bfloat16", "float16")


def dtype_from_name(name: str) -> torch.dtype:
    import torch

    if name not in DTYPE_NAMES:
        raise ValueError(f"unsupported KV dtype {name!r}; expected one of {DTYPE_NAMES}")
    return getattr(torch, name)


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_NAMES:
        raise ValueError(f"unsupported KV dtype {name!r}; expected one of {DTYPE_NAMES}")
    return name


def tensor_bytes(kv: torch.Tensor) -> memoryview:
    """The raw C-contiguous bytes of ``kv`` on the CPU (no copy when already so)."""
    import torch

    t = kv.detach().to("cpu").contiguous()
    # NOTE: view as uint8 so bfloat16 (no numpy dtype) goes through numpy too.
    return memoryview(t.view(torch.uint8).reshape(-1).numpy())


def chunk_ranges(total: int, chunk_bytes: int) -> Iterator[tuple[int, int]]:
    """(offset, end) pairs covering [0, total); one empty range when total is 0."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    if total == 0:
        yield 0, 0
        return
    for off in range(0, total, chunk_bytes):
        yield off, min(off + chunk_bytes, total)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf):
            raise ValueError("truncated varint in KvChunk")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint longer than 10 bytes in KvChunk")


_DATA_FIELD = 9  # KvChunk.data (proto/worker.proto)


def split_kv_chunk(raw: bytes) -> tuple[bytes, memoryview]:
    """A serialized ``KvChunk`` -> (its bytes without ``data``, a view of ``data`` in ``raw``).

    Lets the receiver copy the payload once, straight from gRPC's message into its buffer,
    instead of protobuf parsing it into a new ``bytes`` first. The first part still parses
    as a ``KvChunk`` (fields may come in any order; the last ``data`` wins, as in protobuf).
    Raises ValueError on malformed wire data.
    """
    mv = memoryview(raw)
    rest: list[memoryview] = []
    data = mv[0:0]
    pos = 0
    while pos < len(mv):
        start = pos
        key, pos = _read_varint(mv, pos)
        wire_type = key & 7
        if wire_type == 0:
            _, pos = _read_varint(mv, pos)
        elif wire_type == 1:
            pos += 8
        elif wire_type == 5:
            pos += 4
        elif wire_type == 2:
            n, pos = _read_varint(mv, pos)
            if key >> 3 == _DATA_FIELD:
                data = mv[pos:pos + n]
                if len(data) != n:
                    raise ValueError("truncated data field in KvChunk")
                pos += n
                continue
            pos += n
        else:
            raise ValueError(f"unsupported wire type {wire_type} in KvChunk")
        if pos > len(mv):
            raise ValueError("truncated field in KvChunk")
        rest.append(mv[start:pos])
    return b"".join(rest), data


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


_OFFSET_TAG = b"\x40"  # KvChunk.offset: field 8, varint
_DATA_TAG = b"\x4a"  # KvChunk.data: field 9, length-delimited


def kv_header(request_id: str, kv: torch.Tensor, first_token: int, first_block: int,
              prefill_worker_id: str, token: bytes = b"",
              first_logprob: TokenLogprob | None = None) -> worker_pb2.KvChunk:
    """The first chunk's header fields (no payload); ``token`` is the job's transfer token."""
    if kv.dim() != 6 or kv.shape[1] != 2:
        raise ValueError(f"kv must be (layers, 2, blocks, block_size, heads, dim), got {tuple(kv.shape)}")
    head = worker_pb2.KvChunk(
        request_id=request_id, first_token=first_token, first_block=first_block,
        num_blocks=kv.shape[2], dtype=dtype_name(kv.dtype), shape=list(kv.shape),
        prefill_worker_id=prefill_worker_id, transfer_token=token)
    if first_logprob is not None:
        head.first_logprob.CopyFrom(logprob_to_pb(first_logprob))
    return head


def kv_chunks(request_id: str, kv: torch.Tensor, first_token: int, first_block: int,
              prefill_worker_id: str, chunk_bytes: int, token: bytes = b"",
              first_logprob: TokenLogprob | None = None) -> Iterator[bytes]:
    """The serialized ``KvChunk`` messages of one transfer: header fields on the first,
    ``offset`` + ``data`` on every one.

    ``kv``: (layers, 2, num_blocks, block_size, kv_heads, head_dim). The messages are
    encoded here rather than by protobuf so each payload byte is copied once (the slice
    is joined straight into the message), not twice; the result parses as a KvChunk.
    """
    head = kv_header(request_id, kv, first_token, first_block, prefill_worker_id,
                     token, first_logprob).SerializeToString()
    raw = tensor_bytes(kv)
    for off, end in chunk_ranges(len(raw), chunk_bytes):
        yield b"".join((head, _OFFSET_TAG, _varint(off), _DATA_TAG, _varint(end - off), raw[off:end]))
        head = b""
