"""Prefill side of the KV transfer: stream one request's KV + first token to a decode
worker's ``KvTransfer`` (client streaming, raw bytes in chunks under gRPC's message limit)."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import torch

from services.common.kv_wire import chunk_ranges, dtype_name, tensor_bytes
from services.gen import worker_pb2, worker_pb2_grpc


def kv_chunks(request_id: str, kv: torch.Tensor, first_token: int, first_block: int,
              prefill_worker_id: str, chunk_bytes: int) -> Iterator[worker_pb2.KvChunk]:
    """The messages of one transfer: header fields on the first, ``data`` on every one.

    ``kv``: (layers, 2, num_blocks, block_size, kv_heads, head_dim).
    """
    if kv.dim() != 6 or kv.shape[1] != 2:
        raise ValueError(f"kv must be (layers, 2, blocks, block_size, heads, dim), got {tuple(kv.shape)}")
    raw = tensor_bytes(kv)
    first = True
    for off, end in chunk_ranges(len(raw), chunk_bytes):
        # NOTE: bytes() copies the slice once; protobuf needs bytes, not a memoryview.
        if first:
            yield worker_pb2.KvChunk(
                request_id=request_id, first_token=first_token, first_block=first_block,
                num_blocks=kv.shape[2], dtype=dtype_name(kv.dtype), shape=list(kv.shape),
                prefill_worker_id=prefill_worker_id, offset=off, data=bytes(raw[off:end]))
            first = False
        else:
            yield worker_pb2.KvChunk(offset=off, data=bytes(raw[off:end]))


class KvSender:
    """Channels to decode workers, one per address, reused across transfers."""

    def __init__(self, prefill_worker_id: str, chunk_bytes: int) -> None:
        self.worker_id = prefill_worker_id
        self.chunk_bytes = chunk_bytes
        self._stubs: dict[str, tuple[grpc.aio.Channel, worker_pb2_grpc.DecodeWorkerStub]] = {}

    def _stub(self, address: str) -> worker_pb2_grpc.DecodeWorkerStub:
        entry = self._stubs.get(address)
        if entry is None:
            ch = grpc.aio.insecure_channel(address)
            entry = (ch, worker_pb2_grpc.DecodeWorkerStub(ch))
            self._stubs[address] = entry
        return entry[1]

    async def send(self, address: str, request_id: str, kv: torch.Tensor, first_token: int,
                   first_block: int, timeout_s: float | None = None) -> worker_pb2.KvTransferAck:
        """Deliver; the decode worker's answer. Raises grpc.aio.AioRpcError if unreachable."""
        chunks = kv_chunks(request_id, kv, first_token, first_block, self.worker_id, self.chunk_bytes)
        return await self._stub(address).KvTransfer(chunks, timeout=timeout_s)

    async def close(self) -> None:
        for ch, _ in self._stubs.values():
            await ch.close()
        self._stubs.clear()
