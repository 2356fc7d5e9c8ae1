"""proto/encode.proto <-> embedding.py: the embedding transfer's ask and chunks."""

from __future__ import annotations

import numpy as np

from services.api.embedding import TransferChunk, TransferRequest
from services.api.images_codec import image_from_pb
from services.gen import encode_pb2, multimodal_pb2


def ask_to_pb(req: TransferRequest) -> encode_pb2.EmbeddingTransferRequest:
    return encode_pb2.EmbeddingTransferRequest(
        transfer_id=req.req_id, image=multimodal_pb2.ImageInput(data=req.image, content_hash=req.image_hash),
        sent_tokens=req.sent_tokens, capacity_tokens=req.capacity_tokens)


def ask_from_pb(m: encode_pb2.EmbeddingTransferRequest) -> TransferRequest:
    """Raises ValueError naming a bad field."""
    if not m.transfer_id:
        raise ValueError("transfer_id: must not be empty")
    if m.capacity_tokens == 0:
        raise ValueError("capacity_tokens: must be positive")
    image = image_from_pb(m.image)
    return TransferRequest(m.transfer_id, image.content_hash, image.data, m.sent_tokens, m.capacity_tokens)


def chunk_to_pb(c: TransferChunk) -> encode_pb2.EmbeddingChunk:
    rows = c.embeds.float().contiguous()
    return encode_pb2.EmbeddingChunk(data=rows.numpy().astype("<f4", copy=False).tobytes(), rows=rows.shape[0],
                                     hidden=rows.shape[1], total_tokens=c.total_tokens, offset=c.offset,
                                     is_last=c.is_last)


def chunk_from_pb(m: encode_pb2.EmbeddingChunk) -> TransferChunk:
    """Raises ValueError when the payload is not rows x hidden float32."""
    if len(m.data) != 4 * m.rows * m.hidden:
        raise ValueError(f"chunk of {len(m.data)} bytes is not {m.rows}x{m.hidden} float32")
    import torch  # NOTE: here, not at the top: api stays importable without torch


    arr = np.frombuffer(m.data, dtype="<f4").reshape(m.rows, m.hidden)
    return TransferChunk(torch.from_numpy(arr.copy()), m.total_tokens, m.offset, m.is_last)
