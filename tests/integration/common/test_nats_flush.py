"""``nats_client.flush`` is a barrier: the server has every command issued before it.

nats-py's own ``flush()`` writes its PING ahead of commands still queued for the flusher
task, so a subscription made just before can reach the server after the PONG; a peer's
publish then found no subscriber (the permissions test lost 1 run in 20 that way)."""

from __future__ import annotations

import asyncio

import nats
import pytest

from services.common.nats_client import flush

pytestmark = pytest.mark.asyncio


def _record_writes(nc: nats.NATS) -> list[bytes]:
    """Every byte the connection writes from now on, in order."""
    out: list[bytes] = []
    transport = nc._transport
    write, writelines = transport.write, transport.writelines

    def rec_write(b: bytes) -> None:
        out.append(bytes(b))
        write(b)

    def rec_writelines(lines: list[bytes]) -> None:
        out.extend(bytes(x) for x in lines)
        writelines(lines)

    transport.write, transport.writelines = rec_write, rec_writelines
    return out


async def test_the_ping_follows_the_subscription(nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    try:
        wire = _record_writes(nc)
        await nc.subscribe("flush.barrier")
        await flush(nc)
        stream = b"".join(wire)
        assert b"SUB flush.barrier" in stream and b"PING\r\n" in stream, stream
        assert stream.index(b"SUB flush.barrier") < stream.index(b"PING\r\n"), stream
    finally:
        await nc.close()


async def test_a_peer_publish_right_after_flush_is_delivered(nats_url: str) -> None:
    """The property the barrier exists for, many times over: subscribe, flush, and a publish
    from another connection is heard every time."""
    sub_nc, pub_nc = await nats.connect(nats_url), await nats.connect(nats_url)
    try:
        for i in range(50):
            got: list[bytes] = []

            async def cb(msg: nats.aio.msg.Msg, into: list[bytes] = got) -> None:
                into.append(msg.data)

            sub = await sub_nc.subscribe(f"flush.peer.{i}", cb=cb)
            await flush(sub_nc)
            await pub_nc.publish(f"flush.peer.{i}", b"x")
            await flush(pub_nc)
            # NOTE: the callback runs in the subscription's own task; the bound only keeps a
            # lost message from hanging the test.
            async with asyncio.timeout(5):
                while not got:
                    await asyncio.sleep(0.001)
            assert got == [b"x"], i
            await sub.unsubscribe()
    finally:
        await sub_nc.close()
        await pub_nc.close()
