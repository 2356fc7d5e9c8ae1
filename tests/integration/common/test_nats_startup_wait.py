"""A part's first connect to NATS: it waits for a nats-server that is still starting, and
gives up naming the server after ``nats.startup_wait_s`` when none comes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from services.common.config import NatsConfig
from services.common.nats_client import NatsUnreachableError, connect
from tests.support.ports import free_port
from tests.support.procs import NatsServer, needs_nats_server

pytestmark = pytest.mark.asyncio


async def test_no_server_is_a_clear_error_after_the_wait() -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(NatsUnreachableError, match=rf"{url}.*nats.startup_wait_s=1\.5"):
        await connect(NatsConfig(url=url, startup_wait_s=1.5), "startup-test")
    assert loop.time() - started >= 1.5  # it did retry for the whole wait


async def test_a_server_that_starts_within_the_wait_is_reached(tmp_path: Path) -> None:
    needs_nats_server()
    server = NatsServer(tmp_path / "nats")
    attempt = asyncio.create_task(connect(NatsConfig(url=server.url, startup_wait_s=30), "startup-test"))
    await asyncio.sleep(1.0)
    assert not attempt.done()  # nothing listens yet: still retrying
    server.start()
    try:
        nc = await asyncio.wait_for(attempt, 20)
        assert nc.is_connected
        await nc.close()
    finally:
        server.stop()
