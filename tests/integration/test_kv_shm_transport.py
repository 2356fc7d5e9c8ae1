"""KvSender -> real gRPC server -> KvReceiver over /dev/shm: delivered bit-exact with no
segment left behind, and resent as gRPC bytes when the receiver cannot use the segment."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest
import pytest_asyncio
import torch

from services.decode import kv_receiver
from services.decode.grpc_server import SERVER_OPTIONS, DecodeWorkerServicer, add_decode_servicer
from services.decode.kv_receiver import NOT_WAITING, ExpectedKv, KvReceiver
from services.disagg import kv_shm
from services.prefill import kv_sender
from services.prefill.kv_sender import KvSender

pytestmark = pytest.mark.asyncio

SHAPE = (2, 2, 5, 4, 2, 8)  # (layers, K/V, blocks, block_size, heads, dim)


@dataclass
class _Worker:
    receiver: KvReceiver


@dataclass
class Ends:
    receiver: KvReceiver
    sender: KvSender
    address: str


@pytest_asyncio.fixture
async def ends() -> AsyncIterator[Ends]:
    rx = KvReceiver()
    server = grpc.aio.server(options=SERVER_OPTIONS)
    add_decode_servicer(DecodeWorkerServicer(_Worker(rx)), server)  # type: ignore[arg-type]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    sender = KvSender("p", chunk_bytes=1024)
    try:
        yield Ends(rx, sender, f"127.0.0.1:{port}")
    finally:
        await sender.close()
        await server.stop(grace=0)


@pytest.fixture
def segments(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths of the segments the sender names during the test (recorded, not faked)."""
    made: list[str] = []

    def recording() -> str:
        name = kv_shm.new_segment_name()
        made.append(os.path.join(kv_shm.SHM_DIR, name))
        return name

    monkeypatch.setattr(kv_sender, "new_segment_name", recording)
    return made


async def test_shm_send_is_exact_and_leaves_no_segment(ends: Ends, segments: list[str]) -> None:
    kv = torch.randn(SHAPE)
    fut = ends.receiver.expect("r", ExpectedKv(2, 5, SHAPE, torch.float32))
    sent = await ends.sender.send(ends.address, "r", kv, 3, 2, timeout_s=10, shm=True)
    assert sent.transport == "shm" and sent.ack.accepted
    got = await fut
    assert torch.equal(got.kv, kv) and got.first_token == 3
    # not waiting any more: refused, and that segment is removed as well
    late = await ends.sender.send(ends.address, "r", kv, 3, 2, timeout_s=10, shm=True)
    assert not late.ack.accepted and late.ack.error == NOT_WAITING
    assert len(segments) == 2 and not any(os.path.exists(p) for p in segments)


async def test_unusable_segment_falls_back_to_grpc_bytes(ends: Ends, segments: list[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    def private_shm(name: str, nbytes: int):
        # What a decode worker with its own /dev/shm mount sees: no such file.
        raise kv_shm.ShmUnavailableError(f"cannot open {name}: no such file")

    monkeypatch.setattr(kv_receiver, "map_segment", private_shm)
    kv = torch.randn(SHAPE)
    fut = ends.receiver.expect("r", ExpectedKv(2, 5, SHAPE, torch.float32))
    sent = await ends.sender.send(ends.address, "r", kv, 3, 2, timeout_s=10, shm=True)
    assert sent.transport == "grpc" and sent.ack.accepted
    assert torch.equal((await fut).kv, kv)
    assert len(segments) == 1 and not os.path.exists(segments[0])
