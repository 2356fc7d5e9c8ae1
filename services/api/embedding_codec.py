"""proto/encode.proto <-> embedding.py: the embedding transfer's ask and chunks.

A chunk's rows cross as raw bytes in the encode side's dtype: ``chunk_to_wire`` joins the
header and the rows once (no float32 widening, no protobuf copy), ``chunk_from_wire`` views
them in the received message (no copy; the receiver copies them once, into the image's
tensor). Rows written into the language side's shared-memory segment cross as the header
only (``placed``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from services.api.embedding import ShmTarget, TransferChunk, TransferRequest
from services.api.images_codec import image_from_pb
from services.api.raw_bytes import split_bytes_field, with_bytes_field
from services.gen import encode_pb2, multimodal_pb2

if TYPE_CHECKING:
    import torch

_DATA_FIELD = 1  # EmbeddingChunk.data
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


def chunk_to_wire(c: TransferChunk) -> bytes:
    """The serialized EmbeddingChunk: the rows' raw bytes copied once, or none when placed."""
    import torch

    head = _header(c).SerializeToString()
    if c.placed:
        return head
    rows = c.embeds.detach().to("cpu").contiguous()
    # NOTE: as uint8 so bfloat16 (no numpy dtype) goes through numpy too.
    return with_bytes_field(head, _DATA_FIELD, memoryview(rows.view(torch.uint8).reshape(-1).numpy()))


def chunk_from_wire(raw: bytes, placed_rows: Callable[[int], torch.Tensor] | None = None) -> TransferChunk:
    """A serialized EmbeddingChunk -> its TransferChunk, the rows a view of ``raw`` (or, when
    the encode side placed them, of ``placed_rows(nbytes)``: the ask's segment). Raises
    ValueError when it is malformed or the payload is not rows x hidden in its dtype."""
    import warnings

    import torch

    rest, data = split_bytes_field(raw, _DATA_FIELD)
    try:
        m = encode_pb2.EmbeddingChunk.FromString(rest)
    except Exception as e:  # NOTE: protobuf's DecodeError is not a ValueError
        raise ValueError(f"cannot parse EmbeddingChunk: {e}") from None
    if m.dtype not in DTYPE_NAMES:
        raise ValueError(f"chunk dtype {m.dtype!r} is not one of {DTYPE_NAMES}")
    dtype = getattr(torch, m.dtype)
    nbytes = m.rows * m.hidden * torch.empty((), dtype=dtype).element_size()
    if m.in_shm:
        if placed_rows is None or len(data):
            raise ValueError("chunk placed in a shared-memory segment this ask did not offer")
        flat = placed_rows(nbytes)
    else:
        if len(data) != nbytes:
            raise ValueError(f"chunk of {len(data)} bytes is not {m.rows}x{m.hidden} {m.dtype}")
        with warnings.catch_warnings():
            # NOTE: read-only: the receiver only copies out of it.
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(data, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
    return TransferChunk(flat.view(dtype).view(m.rows, m.hidden), m.total_tokens, m.offset, m.is_last, m.in_shm)
