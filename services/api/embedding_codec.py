"""proto/encode.proto <-> embedding.py: the embedding transfer's ask and chunks.

A chunk's rows cross as raw bytes in the encode side's dtype, streamed in pieces:
``chunk_to_wire`` joins the header and each piece once (no float32 widening, no protobuf
copy); the receiver views each piece in the received message (``split_chunk``,
``bytes_view``: no copy) and copies it once. Rows written into the language side's
shared-memory segment cross as the header only (``placed``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from services.api.embedding import ShmTarget, TransferChunk, TransferRequest
from services.api.images_codec import image_from_pb
from services.api.raw_bytes import split_bytes_field, varint, with_bytes_field
from services.gen import encode_pb2, multimodal_pb2

if TYPE_CHECKING:
    import torch

_DATA_FIELD = 1  # EmbeddingChunk.data
_BYTE_OFFSET_TAG = b"\x48"  # EmbeddingChunk.byte_offset: field 9, varint
# Rows per streamed message: gRPC moves a stream of ~1 MiB messages several times faster
# than one message of tens of MB (docs/benchmarks.md, "Transfers").
PIECE_BYTES = 1 << 20
DTYPE_NAMES = ("float32", "bfloat16", "float16")


def ask_to_pb(req: TransferRequest) -> encode_pb2.EmbeddingTransferRequest:
    m = encode_pb2.EmbeddingTransferRequest(
        transfer_id=req.req_id, image=multimodal_pb2.ImageInput(data=req.image, content_hash=req.image_hash),
        sent_tokens=req.sent_tokens, capacity_tokens=req.capacity_tokens)
    if req.shm is not None:
        m.shm_host_id, m.shm_name = req.shm.host_id, req.shm.name
        m.shm_offset, m.shm_size = req.shm.offset, req.shm.size
    return m


def ask_from_pb(m: encode_pb2.EmbeddingTransferRequest) -> TransferRequest:
    """Raises ValueError naming a bad field."""
    if not m.transfer_id:
        raise ValueError("transfer_id: must not be empty")
    if m.capacity_tokens == 0:
        raise ValueError("capacity_tokens: must be positive")
    image = image_from_pb(m.image)
    shm = None
    if m.shm_name:
        if not m.shm_host_id or m.shm_offset == 0 or m.shm_offset >= m.shm_size:
            raise ValueError("shm_name: needs shm_host_id and 0 < shm_offset < shm_size")
        shm = ShmTarget(m.shm_host_id, m.shm_name, m.shm_offset, m.shm_size)
    return TransferRequest(m.transfer_id, image.content_hash, image.data, m.sent_tokens, m.capacity_tokens,
                           shm=shm)


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_NAMES:
        raise ValueError(f"unsupported embedding dtype {name!r}; expected one of {DTYPE_NAMES}")
    return name


def _header(c: TransferChunk) -> encode_pb2.EmbeddingChunk:
    rows, hidden = c.embeds.shape
    return encode_pb2.EmbeddingChunk(rows=rows, hidden=hidden, total_tokens=c.total_tokens, offset=c.offset,
                                     is_last=c.is_last, dtype=dtype_name(c.embeds.dtype), in_shm=c.placed)


def chunk_to_wire(c: TransferChunk, piece_bytes: int = PIECE_BYTES) -> Iterator[bytes]:
    """The serialized EmbeddingChunk messages of one chunk: the header and the rows' raw
    bytes in pieces of ``piece_bytes``, each byte copied once; the header alone when placed."""
    import torch

    head = _header(c).SerializeToString()
    if c.placed:
        yield head
        return
    rows = c.embeds.detach().to("cpu").contiguous()
    # NOTE: as uint8 so bfloat16 (no numpy dtype) goes through numpy too.
    raw = memoryview(rows.view(torch.uint8).reshape(-1).numpy())
    for off in range(0, max(len(raw), 1), piece_bytes):
        yield with_bytes_field(b"".join((head, _BYTE_OFFSET_TAG, varint(off))), _DATA_FIELD,
                               raw[off:off + piece_bytes])
        head = b""


def split_chunk(raw: bytes) -> tuple[encode_pb2.EmbeddingChunk, memoryview]:
    """A serialized EmbeddingChunk -> (its fields but data, a view of data in ``raw``).
    Raises ValueError when it is malformed."""
    rest, data = split_bytes_field(raw, _DATA_FIELD)
    try:
        return encode_pb2.EmbeddingChunk.FromString(rest), data
    except Exception as e:  # NOTE: protobuf's DecodeError is not a ValueError
        raise ValueError(f"cannot parse EmbeddingChunk: {e}") from None


def chunk_layout(m: encode_pb2.EmbeddingChunk) -> tuple[torch.dtype, int]:
    """(the rows' dtype, their byte count) from a chunk's header; ValueError for a bad dtype."""
    import torch

    if m.dtype not in DTYPE_NAMES:
        raise ValueError(f"chunk dtype {m.dtype!r} is not one of {DTYPE_NAMES}")
    dtype = getattr(torch, m.dtype)
    return dtype, m.rows * m.hidden * torch.empty((), dtype=dtype).element_size()


def chunk_from_rows(m: encode_pb2.EmbeddingChunk, flat: torch.Tensor) -> TransferChunk:
    """The TransferChunk of a header and its rows' bytes (uint8, exactly chunk_layout's count)."""
    dtype, _ = chunk_layout(m)
    return TransferChunk(flat.view(dtype).view(m.rows, m.hidden), m.total_tokens, m.offset, m.is_last, m.in_shm)


def bytes_view(data: memoryview) -> torch.Tensor:
    """A uint8 tensor over received bytes, no copy (read-only: the receiver copies out of it)."""
    import warnings

    import torch

    if not len(data):
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # NOTE: torch warns that it is not writable
        return torch.frombuffer(data, dtype=torch.uint8)
