"""Prefill side of the KV transfer: stream one request's KV + first token to a decode
worker's ``KvTransfer`` (client streaming, raw bytes in chunks under gRPC's message limit),
or, on the same host, pass it through a /dev/shm segment and send only the header: a
reusable segment of this worker's pool (services/disagg/shm_pool.py) when it has room, a
one-shot one (services/disagg/kv_shm.py) otherwise."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Literal

import grpc
import torch

from services.api.outputs import TokenLogprob
from services.common.grpc_auth import call_metadata
from services.disagg.kv_shm import (
    SHM_UNAVAILABLE,
    ShmUnavailableError,
    new_segment_name,
    unlink_segment,
    write_segment,
)
from services.disagg.kv_wire import kv_chunks, kv_header, tensor_bytes
from services.disagg.shm_pool import HEADER_BYTES, Segment, SegmentPool
from services.gen import worker_pb2

log = logging.getLogger(__name__)

# The generated stub's method path (proto/worker.proto: tandem.worker.DecodeWorker).
KV_TRANSFER_METHOD = "/tandem.worker.DecodeWorker/KvTransfer"


@dataclass(frozen=True, slots=True)
class SentKv:
    ack: worker_pb2.KvTransferAck  # the decode worker's answer
    transport: Literal["shm", "grpc"]  # how the bytes went in the end


class KvSender:
    """Channels to decode workers, one per address, reused across transfers."""

    def __init__(self, prefill_worker_id: str, chunk_bytes: int, shm_pool_bytes: int = 1 << 30) -> None:
        self.worker_id = prefill_worker_id
        self.chunk_bytes = chunk_bytes
        # NOTE: names through this module's new_segment_name (tests record the segments made).
        self.segments = SegmentPool(shm_pool_bytes, lambda: new_segment_name())
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
                   first_block: int, timeout_s: float | None = None, shm: bool = False, *,
                   token: bytes, first_logprob: TokenLogprob | None = None) -> SentKv:
        """Deliver with the job's transfer ``token``; the decode worker's answer. Raises
        grpc.aio.AioRpcError if unreachable. ``address`` must be one discovery lists for the
        job's decode worker: the caller checks (services/prefill/decode_directory.py).

        ``shm``: try the same-host path first (the caller knows both ends share /dev/shm);
        if the segment cannot be written here or used there, send the bytes over gRPC.
        """
        if shm and kv.numel() > 0:  # an empty segment cannot be mapped
            ack = await self._send_shm(address, request_id, kv, first_token, first_block, timeout_s,
                                       token, first_logprob)
            if ack is not None:
                return SentKv(ack, "shm")
        chunks = kv_chunks(request_id, kv, first_token, first_block, self.worker_id, self.chunk_bytes,
                           token, first_logprob)
        return SentKv(await self._call(address)(chunks, timeout=timeout_s,
                                                   metadata=call_metadata()), "grpc")

    async def _send_shm(self, address: str, request_id: str, kv: torch.Tensor, first_token: int,
                        first_block: int, timeout_s: float | None, token: bytes,
                        first_logprob: TokenLogprob | None = None
                        ) -> worker_pb2.KvTransferAck | None:
        """The shared-memory transfer's ack; None when it could not be used (send bytes)."""
        head = kv_header(request_id, kv, first_token, first_block, self.worker_id, token,
                         first_logprob)
        for _ in range(2):
            try:
                seg = self.segments.take(address, kv.numel() * kv.element_size())
            except ShmUnavailableError as e:
                log.info("KV for %s over gRPC bytes: %s", request_id, e)
                return None
            if seg is None:
                return await self._send_one_shot(address, head, kv, timeout_s)
            reused = not seg.fresh
            ack = await self._send_pooled(address, head, kv, seg, timeout_s)
            if ack is not None:
                return ack
            if not reused:
                return None
            # NOTE: the decode worker lost its mappings (restarted at this address): every
            # segment it had is useless; once more through a fresh one.
            self.segments.forget(address)
        return None

    async def _send_pooled(self, address: str, head: worker_pb2.KvChunk, kv: torch.Tensor, seg: Segment,
                           timeout_s: float | None) -> worker_pb2.KvTransferAck | None:
        head.shm_name, head.shm_offset, head.shm_size = seg.name, HEADER_BYTES, seg.size
        ack = None
        try:
            # NOTE: in a thread: the copy takes tens of ms for a few hundred MB.
            await asyncio.to_thread(seg.write, kv.detach().to("cpu").contiguous())
            ack = await self._call(address)(iter((head.SerializeToString(),)), timeout=timeout_s,
                                            metadata=call_metadata())
        finally:
            unlink_segment(seg.name)
            if ack is None:  # cancelled or failed: the decode worker may still be reading it
                self.segments.drop(seg)
        if ack.accepted:
            self.segments.kept(seg)
            return ack
        if ack.error.startswith(SHM_UNAVAILABLE):
            log.info("KV for %s not through shared memory: decode worker answered %s", head.request_id, ack.error)
            self.segments.drop(seg)
            return None
        self.segments.idle(seg)
        return ack

    async def _send_one_shot(self, address: str, head: worker_pb2.KvChunk, kv: torch.Tensor,
                             timeout_s: float | None) -> worker_pb2.KvTransferAck | None:
        """A segment of its own for this transfer (the pool is off or full)."""
        head.shm_name = new_segment_name()
        request_id = head.request_id
        # NOTE: in a thread (a few hundred MB take ~0.1 s); the segment is unlinked only
        # after the write ended, or a cancelled send could leave a file created later.
        write = asyncio.ensure_future(asyncio.to_thread(write_segment, head.shm_name, tensor_bytes(kv)))
        try:
            try:
                await asyncio.shield(write)
            except ShmUnavailableError as e:
                log.info("KV for %s over gRPC bytes: %s", request_id, e)
                return None
            ack = await self._call(address)(iter((head.SerializeToString(),)), timeout=timeout_s,
                                            metadata=call_metadata())
        finally:
            if not write.done():
                await asyncio.wait({write})
            unlink_segment(head.shm_name)
        if not ack.accepted and ack.error.startswith(SHM_UNAVAILABLE):
            log.info("KV for %s over gRPC bytes: decode worker answered %s", request_id, ack.error)
            return None
        return ack

    async def close(self) -> None:
        self.segments.close()
        for ch, _ in self._stubs.values():
            await ch.close()
        self._stubs.clear()


def _already_serialized(msg: bytes) -> bytes:
    return msg
