"""split_kv_chunk (the decode worker's raw KvChunk parse) and ByteBufferPool reuse."""

from __future__ import annotations

import pytest
import torch

from services.disagg.byte_buffers import ByteBufferPool
from services.disagg.kv_wire import kv_chunks, split_kv_chunk
from services.gen import worker_pb2


def test_split_matches_protobuf_parse_for_every_chunk() -> None:
    kv = torch.randn(2, 2, 3, 4, 1, 2)
    for raw in kv_chunks("r", kv, 9, 1, "p", 40):
        rest, data = split_kv_chunk(raw)
        want = worker_pb2.KvChunk.FromString(raw)
        got = worker_pb2.KvChunk.FromString(rest)
        assert bytes(data) == want.data and got.data == b""
        got.data = bytes(data)
        assert got == want


def test_split_handles_data_before_the_header_and_repeated_data() -> None:
    msg = worker_pb2.KvChunk(data=b"old").SerializeToString() + worker_pb2.KvChunk(
        request_id="r", shape=[1, 2], offset=300).SerializeToString() + worker_pb2.KvChunk(
        data=b"new").SerializeToString()
    rest, data = split_kv_chunk(msg)
    assert bytes(data) == b"new"  # protobuf: the last occurrence wins
    head = worker_pb2.KvChunk.FromString(rest)
    assert (head.request_id, list(head.shape), head.offset) == ("r", [1, 2], 300)


@pytest.mark.parametrize("raw", [b"\x4a\x05abc", b"\x40\xff", b"\x0b"])
def test_split_rejects_malformed_bytes(raw: bytes) -> None:
    with pytest.raises(ValueError, match="KvChunk"):
        split_kv_chunk(raw)


def test_pool_reuses_a_given_back_buffer_and_caps_idle_bytes() -> None:
    pool = ByteBufferPool(max_bytes=100)
    a = pool.take(80)
    assert a.numel() == 80 and a.dtype == torch.uint8
    pool.give(a)
    b = pool.take(50)  # fits in a's memory: same storage, exact length
    assert b.numel() == 50 and b.data_ptr() == a.data_ptr()
    pool.give(b)
    pool.give(pool.take(90))  # a new one: the idle set would be 170 > 100, a is dropped
    assert pool.idle_bytes == 90


def test_a_lent_buffer_comes_back_once_its_last_view_is_gone() -> None:
    pool = ByteBufferPool(max_bytes=1 << 20)
    t = pool.lend(4096)
    rows = t.view(torch.float32).reshape(32, 32)  # as a receiver keeps an image's rows
    ptr = t.data_ptr()
    del t
    assert pool.idle_bytes == 0  # the rows still read it
    del rows
    assert pool.idle_bytes == 4096
    again = pool.lend(2048)  # the same pages: no fresh allocation to fault in
    assert again.data_ptr() == ptr and again.numel() == 2048
    assert pool.idle_bytes == 0


def test_a_lent_buffer_dropped_while_the_pool_is_busy_comes_back_later() -> None:
    """A finalizer may run inside the pool's own code (a garbage collection in ``take``):
    it must neither deadlock on the lock nor reorder the idle list under that code."""
    pool = ByteBufferPool(max_bytes=1 << 20)
    t = pool.lend(4096)
    with pool._lock:
        del t  # the finalizer runs here, under the lock
        assert pool._idle == []
    assert pool.idle_bytes == 4096


@pytest.mark.asyncio
async def test_receiver_answers_an_unparsable_raw_chunk_instead_of_raising() -> None:
    from services.decode.kv_receiver import KvReceiver

    async def one(msg: bytes):
        yield msg

    # request_id (field 1) that is not UTF-8: framing is fine, protobuf refuses the string
    ack = await KvReceiver().receive(one(b"\x0a\x02\xff\xfe"))
    assert not ack.accepted and "malformed KvChunk" in ack.error


def test_pool_takes_the_smallest_fit_among_several_idle_buffers() -> None:
    pool = ByteBufferPool(max_bytes=1000)
    big, small = pool.take(300), pool.take(100)
    pool.give(big)
    pool.give(small)
    got = pool.take(50)  # the smaller one, which is not the first idle
    assert got.numel() == 50 and got._base is small
    assert pool.idle_bytes == 300
