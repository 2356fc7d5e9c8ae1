"""KV tensors as bytes on the wire (DecodeWorker.KvTransfer, MoveKv): dtype names, the
KvChunk messages of one transfer, and reassembly. Torch is imported by the functions that
need it only."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from services.api.raw_bytes import split_bytes_field, varint, with_bytes_field
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


_DATA_FIELD = 9  # KvChunk.data (proto/worker.proto)


def split_kv_chunk(raw: bytes) -> tuple[bytes, memoryview]:
    """A serialized ``KvChunk`` -> (its bytes without ``data``, a view of ``data`` in ``raw``).

    Lets the receiver copy the payload once, straight from gRPC's message into its buffer,
    instead of protobuf parsing it into a new ``bytes`` first. The first part still parses
    as a ``KvChunk`` (fields may come in any order; the last ``data`` wins, as in protobuf).
    Raises ValueError on malformed wire data.
    """
    try:
        return split_bytes_field(raw, _DATA_FIELD)
    except ValueError as e:
        raise ValueError(f"{e} in KvChunk") from None


_OFFSET_TAG = b"\x40"  # KvChunk.offset: field 8, varint


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
        yield with_bytes_field(b"".join((head, _OFFSET_TAG, varint(off))), _DATA_FIELD, raw[off:end])
        head = b""
