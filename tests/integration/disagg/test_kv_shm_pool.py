"""KvSender -> the real decode worker's gRPC server -> its KvReceiver, through the sender's
reusable /dev/shm segments (services/disagg/shm_pool.py): bit-exact in float32 and bfloat16
on both paths, a segment written again once the receiver released it, nothing left in
/dev/shm after success, refusal or a cancelled send, and a receiver that lost or cannot
see the segments gets the KV through a fresh one or as gRPC bytes."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
import pytest_asyncio
import torch

from services.decode import kv_receiver
from services.decode.kv_receiver import NOT_WAITING, ExpectedKv, KvReceiver
from services.disagg import kv_shm
from services.disagg.shm_pool import MappedSegments
from services.disagg.transfer_token import new_token
from services.prefill import kv_sender
from services.prefill.kv_sender import KvSender
from tests.support.mock_cluster import mock_cluster_cfg
from tests.support.stack import worker_decode_node

pytestmark = pytest.mark.asyncio

SHAPE = (2, 2, 5, 4, 2, 8)  # (layers, K/V, blocks, block_size, heads, dim)


@dataclass
class Ends:
    receiver: KvReceiver
    sender: KvSender
    address: str


@pytest_asyncio.fixture
async def ends() -> AsyncIterator[Ends]:
    async with worker_decode_node(mock_cluster_cfg()) as node:
        sender = KvSender("p", chunk_bytes=1024, shm_pool_bytes=64 << 20)
        try:
            yield Ends(node.worker.receiver, sender, node.address)
        finally:
            await sender.close()


@pytest.fixture
def segments(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths of the segments the sender creates during the test."""
    made: list[str] = []

    def recording() -> str:
        name = kv_shm.new_segment_name()
        made.append(os.path.join(kv_shm.SHM_DIR, name))
        return name

    monkeypatch.setattr(kv_sender, "new_segment_name", recording)
    return made


def _kv(dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(SHAPE).to(dtype)


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


async def _send(ends: Ends, rid: str, kv: torch.Tensor, shm: bool):
    token = new_token()
    fut = ends.receiver.expect(rid, ExpectedKv(2, 5, SHAPE, kv.dtype, token))
    sent = await ends.sender.send(ends.address, rid, kv, 3, 2, timeout_s=10, shm=shm, token=token)
    return sent, fut


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shm", [False, True])
async def test_bit_exact_in_the_models_dtype_on_both_paths(ends: Ends, segments: list[str], dtype, shm) -> None:
    kv = _kv(dtype)
    sent, fut = await _send(ends, "r", kv, shm)
    assert sent.ack.accepted and sent.transport == ("shm" if shm else "grpc")
    got = await fut
    assert got.kv.dtype == dtype and _bits(got.kv) == _bits(kv)
    assert sent.ack.bytes_received == kv.numel() * kv.element_size()
    got.release()
    assert len(segments) == (1 if shm else 0) and not any(os.path.exists(p) for p in segments)


async def test_a_released_segment_is_written_again_and_never_named_in_dev_shm(ends: Ends,
                                                                             segments: list[str]) -> None:
    for i in range(3):
        kv = _kv(torch.bfloat16)
        sent, fut = await _send(ends, f"r{i}", kv, True)
        got = await fut
        assert sent.transport == "shm" and _bits(got.kv) == _bits(kv)
        assert not any(os.path.exists(p) for p in segments)
        got.release()
    assert len(segments) == 1  # one segment, written three times
    assert len(ends.sender.segments.segments(ends.address)) == 1 and len(ends.receiver.segments) == 1


async def test_a_segment_still_held_is_not_written_again(ends: Ends, segments: list[str]) -> None:
    a, b = _kv(torch.float32), _kv(torch.float32)
    _, fut_a = await _send(ends, "a", a, True)
    held = await fut_a  # not released: the engine would still be importing it
    _, fut_b = await _send(ends, "b", b, True)
    got_b = await fut_b
    assert len(segments) == 2 and _bits(held.kv) == _bits(a) and _bits(got_b.kv) == _bits(b)


async def test_refused_transfer_keeps_the_segment_for_reuse_and_leaves_no_file(ends: Ends,
                                                                               segments: list[str]) -> None:
    kv = _kv(torch.float32)
    sent, fut = await _send(ends, "r", kv, True)
    (await fut).release()
    late = await ends.sender.send(ends.address, "r", kv, 3, 2, timeout_s=10, shm=True, token=new_token())
    assert not late.ack.accepted and late.ack.error == NOT_WAITING
    sent, fut = await _send(ends, "r2", kv, True)
    assert sent.transport == "shm" and _bits((await fut).kv) == _bits(kv)
    assert len(segments) == 1 and not any(os.path.exists(p) for p in segments)


async def test_cancelled_send_leaves_no_file_and_drops_the_segment(ends: Ends, segments: list[str],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    real = kv_receiver.map_segment

    def slow(name: str, nbytes: int):
        time.sleep(0.3)  # the decode worker is slow to map: the send is cancelled meanwhile
        return real(name, nbytes)

    monkeypatch.setattr(kv_receiver, "map_segment", slow)
    token = new_token()
    ends.receiver.expect("r", ExpectedKv(2, 5, SHAPE, torch.float32, token))
    task = asyncio.create_task(ends.sender.send(ends.address, "r", _kv(torch.float32), 3, 2, timeout_s=10,
                                                shm=True, token=token))
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(segments) == 1 and not os.path.exists(segments[0])
    assert ends.sender.segments.segments(ends.address) == []  # its state is unknown: never reused
    await asyncio.sleep(0.4)
    assert not os.path.exists(segments[0])


async def test_receiver_that_lost_its_mappings_gets_a_fresh_segment(ends: Ends, segments: list[str]) -> None:
    kv = _kv(torch.float32)
    _, fut = await _send(ends, "a", kv, True)
    (await fut).release()
    ends.receiver.segments = MappedSegments(1 << 30)  # a restarted decode worker at that address
    sent, fut = await _send(ends, "b", kv, True)
    assert sent.ack.accepted and sent.transport == "shm" and _bits((await fut).kv) == _bits(kv)
    assert len(segments) == 2 and not any(os.path.exists(p) for p in segments)


async def test_receiver_that_cannot_see_the_segment_gets_grpc_bytes(ends: Ends, segments: list[str],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    def private_shm(name: str, nbytes: int):
        raise kv_shm.ShmUnavailableError(f"cannot open {name}: no such file")

    monkeypatch.setattr(kv_receiver, "map_segment", private_shm)
    kv = _kv(torch.bfloat16)
    sent, fut = await _send(ends, "r", kv, True)
    assert sent.ack.accepted and sent.transport == "grpc" and _bits((await fut).kv) == _bits(kv)
    assert len(segments) == 1 and not os.path.exists(segments[0])
    assert ends.sender.segments.segments(ends.address) == []
