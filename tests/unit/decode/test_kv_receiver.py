"""KvReceiver: header/shape/dtype/count/bytes validation, duplicates and late transfers,
the sender's chunk encoding round trip, and the one-time transfer token."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Iterable

import pytest
import torch

from services.api.outputs import TokenLogprob
from services.decode.kv_receiver import (
    NOT_WAITING,
    ExpectedKv,
    KvReceiver,
    KvRefusal,
    KvTransferError,
)
from services.disagg.kv_wire import kv_chunks
from services.disagg.transfer_token import new_token
from services.gen import worker_pb2

pytestmark = pytest.mark.asyncio

SHAPE = (2, 2, 3, 4, 1, 2)  # (layers, K/V, blocks, block_size, heads, dim)
TOKEN = new_token()
EXPECT = ExpectedKv(first_block=1, num_blocks=3, shape=SHAPE, dtype=torch.float32, token=TOKEN)


async def _stream(msgs: Iterable[worker_pb2.KvChunk]) -> AsyncIterator[worker_pb2.KvChunk]:
    for m in msgs:
        yield m


def _chunks(kv: torch.Tensor, rid: str = "r", first_block: int = 1, chunk: int = 40,
            token: bytes = TOKEN):
    return [worker_pb2.KvChunk.FromString(b)
            for b in kv_chunks(rid, kv, 9, first_block, "p", chunk, token)]


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


async def test_first_logprob_rides_the_header_and_a_mismatched_one_fails_the_wait() -> None:
    kv = torch.randn(SHAPE)
    rx = KvReceiver()
    fut = rx.expect("r", EXPECT)
    lp = TokenLogprob(9, -0.25, ((9, -0.25), (4, -1.5)))
    chunks = [worker_pb2.KvChunk.FromString(b)
              for b in kv_chunks("r", kv, 9, 1, "p", 40, TOKEN, first_logprob=lp)]
    assert (await rx.receive(_stream(chunks))).accepted
    assert (await fut).first_logprob == lp

    fut = rx.expect("r", EXPECT)
    other = TokenLogprob(8, -0.25)  # not the first token's
    chunks = [worker_pb2.KvChunk.FromString(b)
              for b in kv_chunks("r", kv, 9, 1, "p", 40, TOKEN, first_logprob=other)]
    assert not (await rx.receive(_stream(chunks))).accepted
    with pytest.raises(KvTransferError, match="first_logprob"):
        await fut


async def test_expect_twice_is_an_error() -> None:
    rx = KvReceiver()
    rx.expect("r", EXPECT)
    with pytest.raises(ValueError, match="already waiting"):
        rx.expect("r", EXPECT)
    await asyncio.sleep(0)


# ---- the transfer token ---------------------------------------------------------------
def _counting() -> tuple[KvReceiver, list[KvRefusal]]:
    refused: list[KvRefusal] = []
    return KvReceiver(on_refused=refused.append), refused


@pytest.mark.parametrize(("token", "reason", "match"), [
    (b"", KvRefusal.NO_TOKEN, "carries no transfer token"),
    (new_token(), KvRefusal.BAD_TOKEN, "wrong transfer token"),
    (TOKEN[:-1], KvRefusal.BAD_TOKEN, "wrong transfer token"),  # a prefix of the real one
])
async def test_a_transfer_without_the_token_is_refused_and_the_real_one_still_lands(
        token: bytes, reason: KvRefusal, match: str) -> None:
    rx, refused = _counting()
    fut = rx.expect("r", EXPECT)
    forged = torch.full(SHAPE, 7.0)
    ack = await rx.receive(_stream(_chunks(forged, token=token)))
    assert not ack.accepted and re.search(match, ack.error) and ack.bytes_received == 0
    assert refused == [reason]
    # The forgery changed nothing: still waiting, and the real transfer is accepted.
    assert rx.is_waiting("r") and not fut.done()
    kv = torch.randn(SHAPE)
    assert (await rx.receive(_stream(_chunks(kv)))).accepted
    assert torch.equal((await fut).kv, kv)
    # Used up: the same token again finds nothing waiting.
    again = await rx.receive(_stream(_chunks(forged)))
    assert not again.accepted and again.error == NOT_WAITING
    assert refused == [reason, KvRefusal.NOT_WAITING]


async def test_a_forged_transfer_with_a_bad_shape_does_not_end_the_wait() -> None:
    rx, refused = _counting()
    fut = rx.expect("r", EXPECT)
    ack = await rx.receive(_stream(_chunks(torch.randn(2, 2, 2, 4, 1, 2), token=new_token())))
    assert not ack.accepted and refused == [KvRefusal.BAD_TOKEN] and not fut.done()


async def test_the_token_is_held_by_one_transfer_at_a_time_and_handed_back_if_it_is_cut_off() -> None:
    rx, refused = _counting()
    fut = rx.expect("r", EXPECT)
    kv = torch.randn(SHAPE)
    chunks = _chunks(kv)
    gate, holding = asyncio.Event(), asyncio.Event()

    async def stalled() -> AsyncIterator[worker_pb2.KvChunk]:
        yield chunks[0]
        holding.set()  # asked for the payload: past the token check, holding it
        await gate.wait()
        for c in chunks[1:]:
            yield c

    first = asyncio.create_task(rx.receive(stalled()))
    await asyncio.wait_for(holding.wait(), 5)
    second = await rx.receive(_stream(chunks))  # the token, while the first holds it
    assert not second.accepted and "already being received" in second.error
    assert refused == [KvRefusal.TOKEN_IN_USE]
    first.cancel()  # the first stream is cut off (the prefill worker's call went away)
    with pytest.raises(asyncio.CancelledError):
        await first
    assert rx.is_waiting("r") and not fut.done()
    # JetStream's redelivery sends again with the same token: it gets through.
    assert (await rx.receive(_stream(chunks))).accepted
    assert torch.equal((await fut).kv, kv)


async def test_expected_kv_needs_a_drawn_token() -> None:
    for bad in (b"", b"short", new_token()[:16]):
        with pytest.raises(ValueError, match="token"):
            ExpectedKv(first_block=1, num_blocks=3, shape=SHAPE, dtype=torch.float32, token=bad)
    assert TOKEN.hex() not in repr(EXPECT)
