"""A real nats-server (JetStream on) per test module, plus bounded "eventually" polling."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

import pytest

from tests.support.procs import NatsServer, needs_nats_server


@pytest.fixture(scope="module")
def nats_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    needs_nats_server()
    server = NatsServer(tmp_path_factory.mktemp("nats"))
    server.start()
    yield server.url
    server.stop()


async def eventually(check: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    """Poll ``check`` until true; fail (not hang) after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)


@pytest.fixture
def wait_for() -> Callable[..., object]:
    """The ``eventually`` helper as a fixture (test modules do not import conftest)."""
    return eventually
