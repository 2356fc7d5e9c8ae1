"""Prefill side of the KV transfer: stream one request's KV + first token to a decode
worker's ``KvTransfer`` (client streaming, raw bytes in chunks under gRPC's message limit)."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import torch

from services.common.kv_wire import chunk_ranges, dtype_name, tensor_bytes
from services.gen import worker_pb2

# The generated stub's method path (proto/worker.proto: tandem.worker.DecodeWorker).
KV_TRANSFER_METHOD = "/tandem.worker.DecodeWorker/KvTransfer"


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


def kv_chunks(request_id: str, kv: torch.Tensor, first_token: int, first_block: int,
              prefill_worker_id: str, chunk_bytes: int) -> Iterator[bytes]:
    """The serialized ``KvChunk`` messages of one transfer: header fields on the first,
    ``offset`` + ``data`` on every one.

    ``kv``: (layers, 2, num_blocks, block_size, kv_heads, head_dim). The messages are
    encoded here rather than by protobuf so each payload byte is copied once (the slice
    is joined straight into the message), not twice; the result parses as a KvChunk.
    """
    if kv.dim() != 6 or kv.shape[1] != 2:
        raise ValueError(f"kv must be (layers, 2, blocks, block_size, heads, dim), got {tuple(kv.shape)}")
    raw = tensor_bytes(kv)
    head = worker_pb2.KvChunk(
        request_id=request_id, first_token=first_token, first_block=first_block,
        num_blocks=kv.shape[2], dtype=dtype_name(kv.dtype), shape=list(kv.shape),
        prefill_worker_id=prefill_worker_id).SerializeToString()
    for off, end in chunk_ranges(len(raw), chunk_bytes):
        yield b"".join((head, _OFFSET_TAG, _varint(off), _DATA_TAG, _varint(end - off), raw[off:end]))
        head = b""


class KvSender:
    """Channels to decode workers, one per address, reused across transfers."""

    def __init__(self, prefill_worker_id: str, chunk_bytes: int) -> None:
        self.worker_id = prefill_worker_id
        self.chunk_bytes = chunk_bytes
        self._stubs: dict[str, tuple[grpc.aio.Channel, grpc.aio.StreamUnaryMultiCallable]] = {}

    def _call(self, address: str) -> grpc.aio.StreamUnaryMultiCallable:
        entry = self._stubs.get(address)
        if entry is None:
            ch = grpc.aio.insecure_channel(address)
            call = ch.stream_unary(
                KV_TRANSFER_METHOD, request_serializer=_already_serialized,
                response_deserializer=worker_pb2.KvTransferAck.FromString)
            entry = (ch, call)
            self._stubs[address] = entry
        return entry[1]

    async def send(self, address: str, request_id: str, kv: torch.Tensor, first_token: int,
                   first_block: int, timeout_s: float | None = None) -> worker_pb2.KvTransferAck:
        """Deliver; the decode worker's answer. Raises grpc.aio.AioRpcError if unreachable."""
        chunks = kv_chunks(request_id, kv, first_token, first_block, self.worker_id, self.chunk_bytes)
        return await self._call(address)(chunks, timeout=timeout_s)

    async def close(self) -> None:
        for ch, _ in self._stubs.values():
            await ch.close()
        self._stubs.clear()


def _already_serialized(msg: bytes) -> bytes:
    return msg
