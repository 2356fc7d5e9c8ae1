"""KvSender -> the real decode worker's gRPC server (mock-runner engine) -> its KvReceiver
over /dev/shm: delivered bit-exact with no segment left behind, and resent as gRPC bytes when
the receiver cannot use the segment."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
import pytest_asyncio
import torch

from services.decode import kv_receiver
from services.decode.kv_receiver import NOT_WAITING, ExpectedKv, KvReceiver
from services.decode.worker import DecodeWorker
from services.disagg import kv_shm
from services.disagg.transfer_token import new_token
from services.prefill import kv_sender
from services.prefill.kv_sender import KvSender
from tests.support.mock_cluster import mock_cluster_cfg
from tests.support.stack import worker_decode_node

pytestmark = pytest.mark.asyncio

SHAPE = (2, 2, 5, 4, 2, 8)  # (layers, K/V, blocks, block_size, heads, dim)
TOKEN = new_token()


@dataclass
class Ends:
    receiver: KvReceiver
    sender: KvSender
    address: str
    worker: DecodeWorker

    def bytes_received(self) -> float | None:
        """The worker's own count of KV bytes it accepted (its metrics)."""
        return self.worker.metrics.registry.get_sample_value(
            "tandem_worker_kv_transfer_bytes_received_total")


@pytest_asyncio.fixture
async def ends() -> AsyncIterator[Ends]:
    async with worker_decode_node(mock_cluster_cfg()) as node:
        sender = KvSender("p", chunk_bytes=1024)
        try:
            yield Ends(node.worker.receiver, sender, node.address, node.worker)
        finally:
            await sender.close()


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
    fut = ends.receiver.expect("r", ExpectedKv(2, 5, SHAPE, torch.float32, TOKEN))
    sent = await ends.sender.send(ends.address, "r", kv, 3, 2, timeout_s=10, shm=True, token=TOKEN)
    assert sent.transport == "shm" and sent.ack.accepted
    got = await fut
    assert torch.equal(got.kv, kv) and got.first_token == 3
    # not waiting any more: refused, and that segment is removed as well
    late = await ends.sender.send(ends.address, "r", kv, 3, 2, timeout_s=10, shm=True, token=TOKEN)
    assert not late.ack.accepted and late.ack.error == NOT_WAITING
    assert len(segments) == 2 and not any(os.path.exists(p) for p in segments)
    assert ends.bytes_received() == kv.nbytes  # the accepted transfer only


async def test_unusable_segment_falls_back_to_grpc_bytes(ends: Ends, segments: list[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    def private_shm(name: str, nbytes: int):
        # What a decode worker with its own /dev/shm mount sees: no such file.
        raise kv_shm.ShmUnavailableError(f"cannot open {name}: no such file")

    monkeypatch.setattr(kv_receiver, "map_segment", private_shm)
    kv = torch.randn(SHAPE)
    fut = ends.receiver.expect("r", ExpectedKv(2, 5, SHAPE, torch.float32, TOKEN))
    sent = await ends.sender.send(ends.address, "r", kv, 3, 2, timeout_s=10, shm=True, token=TOKEN)
    assert sent.transport == "grpc" and sent.ack.accepted
    assert torch.equal((await fut).kv, kv)
    assert ends.bytes_received() == kv.nbytes
    assert len(segments) == 1 and not os.path.exists(segments[0])
