"""The /dev/shm KV path on the receiving side: exact tensor, the segment always removed
(success, bad header, not waiting), an unusable segment keeps the wait for a gRPC resend."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import pytest
import torch

from services.decode.kv_receiver import NOT_WAITING, ExpectedKv, KvReceiver, KvTransferError
from services.disagg import kv_shm
from services.disagg.kv_wire import kv_header
from services.disagg.transfer_token import new_token
from services.gen import worker_pb2

pytestmark = pytest.mark.asyncio

SHAPE = (2, 2, 3, 4, 1, 2)  # (layers, K/V, blocks, block_size, heads, dim)
TOKEN = new_token()
EXPECT = ExpectedKv(first_block=1, num_blocks=3, shape=SHAPE, dtype=torch.float32, token=TOKEN)


async def _one(msg: bytes) -> AsyncIterator[bytes]:
    yield msg


def _shm_transfer(kv: torch.Tensor, rid: str = "r", write: bool = True,
                  token: bytes = TOKEN) -> tuple[bytes, str]:
    """A header-only KvChunk naming a fresh segment holding ``kv`` (written unless not)."""
    head = kv_header(rid, kv, 9, 1, "p", token)
    head.shm_name = kv_shm.new_segment_name()
    if write:
        kv_shm.write_segment(head.shm_name, memoryview(kv.numpy()).cast("B"))
    return head.SerializeToString(), os.path.join(kv_shm.SHM_DIR, head.shm_name)


async def test_shm_transfer_delivers_the_exact_tensor_and_removes_the_segment() -> None:
    rx = KvReceiver()
    fut = rx.expect("r", EXPECT)
    kv = torch.randn(SHAPE)
    msg, path = _shm_transfer(kv)
    assert os.path.exists(path)
    ack = await rx.receive(_one(msg))
    assert ack.accepted and ack.bytes_received == kv.numel() * 4
    got = await fut
    assert torch.equal(got.kv, kv) and got.first_token == 9
    assert not os.path.exists(path)


async def test_segment_removed_after_a_bad_header_and_when_not_waiting() -> None:
    rx = KvReceiver()
    fut = rx.expect("r", EXPECT)
    msg, path = _shm_transfer(torch.randn(2, 2, 3, 4, 2, 1))  # wrong shape
    ack = await rx.receive(_one(msg))
    assert not ack.accepted and "shape" in ack.error
    with pytest.raises(KvTransferError, match="shape"):
        await fut
    assert not os.path.exists(path)
    msg, path = _shm_transfer(torch.randn(SHAPE), rid="nobody")
    ack = await rx.receive(_one(msg))
    assert not ack.accepted and ack.error == NOT_WAITING and not os.path.exists(path)


async def test_missing_segment_asks_for_a_resend_and_keeps_waiting() -> None:
    rx = KvReceiver()
    rx.expect("r", EXPECT)
    msg, _ = _shm_transfer(torch.randn(SHAPE), write=False)
    ack = await rx.receive(_one(msg))
    assert not ack.accepted and ack.error.startswith(kv_shm.SHM_UNAVAILABLE)
    assert rx.is_waiting("r")


async def test_shm_header_with_data_is_refused_and_bad_names_never_reach_the_filesystem() -> None:
    rx = KvReceiver()
    fut = rx.expect("r", EXPECT)
    msg, path = _shm_transfer(torch.randn(SHAPE))
    ack = await rx.receive(_one(msg + worker_pb2.KvChunk(data=b"xx").SerializeToString()))
    assert not ack.accepted and "also carries data" in ack.error and not os.path.exists(path)
    with pytest.raises(KvTransferError):
        await fut
    for bad in ("../etc/passwd", "tandem-kv-../../x", "other"):
        with pytest.raises(ValueError, match="invalid shared-memory segment name"):
            kv_shm.segment_path(bad)


async def test_host_id_names_this_boot_and_shm_mount() -> None:
    hid = kv_shm.host_id()
    assert hid and hid == kv_shm.host_id()
    st = os.stat(kv_shm.SHM_DIR)
    assert hid.endswith(f"/{st.st_dev}:{st.st_ino}")


async def test_shm_header_without_the_token_is_refused_and_the_real_one_still_lands() -> None:
    rx = KvReceiver()
    fut = rx.expect("r", EXPECT)
    for token in (b"", new_token()):
        msg, path = _shm_transfer(torch.full(SHAPE, 7.0), token=token)
        ack = await rx.receive(_one(msg))
        assert not ack.accepted and "transfer token" in ack.error and not os.path.exists(path)
        assert rx.is_waiting("r") and not fut.done()
    kv = torch.randn(SHAPE)
    msg, _ = _shm_transfer(kv)
    assert (await rx.receive(_one(msg))).accepted
    assert torch.equal((await fut).kv, kv)
