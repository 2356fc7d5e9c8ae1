"""KvReceiver: header/shape/dtype/count/bytes validation, duplicates and late transfers,
and the sender's chunk encoding round trip."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable

import pytest
import torch

from services.decode.kv_receiver import NOT_WAITING, ExpectedKv, KvReceiver, KvTransferError
from services.gen import worker_pb2
from services.prefill.kv_sender import kv_chunks

pytestmark = pytest.mark.asyncio

SHAPE = (2, 2, 3, 4, 1, 2)  # (layers, K/V, blocks, block_size, heads, dim)
EXPECT = ExpectedKv(first_block=1, num_blocks=3, shape=SHAPE, dtype=torch.float32)


async def _stream(msgs: Iterable[worker_pb2.KvChunk]) -> AsyncIterator[worker_pb2.KvChunk]:
    for m in msgs:
        yield m


def _chunks(kv: torch.Tensor, rid: str = "r", first_block: int = 1, chunk: int = 40):
    return [worker_pb2.KvChunk.FromString(b) for b in kv_chunks(rid, kv, 9, first_block, "p", chunk)]


async def test_good_transfer_resolves_with_the_exact_tensor_and_duplicates_are_refused() -> None:
    rx = KvReceiver()
    fut = rx.expect("r", EXPECT)
    kv = torch.randn(SHAPE)
    ack = await rx.receive(_stream(_chunks(kv)))
    assert ack.accepted and ack.bytes_received == kv.numel() * 4
    got = await fut
    assert torch.equal(got.kv, kv) and got.first_token == 9 and got.prefill_worker_id == "p"
    dup = await rx.receive(_stream(_chunks(kv)))
    assert not dup.accepted and dup.error == NOT_WAITING


async def test_transfer_for_a_request_not_waiting_is_refused() -> None:
    rx = KvReceiver()
    ack = await rx.receive(_stream(_chunks(torch.randn(SHAPE), rid="other")))
    assert not ack.accepted and ack.error == NOT_WAITING
    fut = rx.expect("late", EXPECT)
    rx.cancel("late")  # the decode worker timed out and prefilled locally
    assert fut.cancelled()
    ack = await rx.receive(_stream(_chunks(torch.randn(SHAPE), rid="late")))
    assert not ack.accepted and ack.error == NOT_WAITING


@pytest.mark.parametrize(("kv", "first_block", "match"), [
    (torch.randn(2, 2, 2, 4, 1, 2), 1, r"blocks \[1, \+2\); expected \[1, \+3\)"),
    (torch.randn(SHAPE), 0, r"expected \[1, \+3\)"),
    (torch.randn(2, 2, 3, 4, 2, 1), 1, r"shape \(2, 2, 3, 4, 2, 1\); expected"),
    (torch.randn(SHAPE, dtype=torch.float64).to(torch.float16), 1, "dtype float16"),
])
async def test_bad_header_fails_the_wait(kv: torch.Tensor, first_block: int, match: str) -> None:
    rx = KvReceiver()
    fut = rx.expect("r", EXPECT)
    ack = await rx.receive(_stream(_chunks(kv, first_block=first_block)))
    assert not ack.accepted
    with pytest.raises(KvTransferError, match=match):
        await fut
    assert not rx.is_waiting("r")


@pytest.mark.parametrize(("mutate", "match"), [
    (lambda cs: cs[:-1], "ended at"),  # a chunk missing at the end
    (lambda cs: [cs[0], *cs[2:]], "at offset 80; expected 40"),
    (lambda cs: [*cs, worker_pb2.KvChunk(offset=384, data=b"x")], "longer than its shape"),
])
async def test_bad_payload_fails_the_wait(mutate, match: str) -> None:
    rx = KvReceiver()
    fut = rx.expect("r", EXPECT)
    ack = await rx.receive(_stream(mutate(_chunks(torch.randn(SHAPE)))))
    assert not ack.accepted
    with pytest.raises(KvTransferError, match=match):
        await fut


async def test_expect_twice_is_an_error() -> None:
    rx = KvReceiver()
    rx.expect("r", EXPECT)
    with pytest.raises(ValueError, match="already waiting"):
        rx.expect("r", EXPECT)
    await asyncio.sleep(0)
