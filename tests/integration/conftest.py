"""A real nats-server (JetStream on) per test module, plus bounded "eventually" polling."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from services.common.env import in_ci
from tests.support.ports import free_port


@pytest.fixture(scope="module")
def nats_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary = shutil.which("nats-server") or ("/usr/sbin/nats-server" if Path("/usr/sbin/nats-server").exists() else None)
    if binary is None:
        if in_ci():
            pytest.fail("nats-server is not installed (CI must have it: `make nats`)")
        pytest.skip("nats-server is not installed; `make nats` installs it")
    port = free_port()
    store = tmp_path_factory.mktemp("nats")
    proc = subprocess.Popen(
        [binary, "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", str(store)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 10
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                err = proc.stderr.read().decode() if proc.stderr else ""
                pytest.fail(f"nats-server did not start on port {port}: {err[-2000:]}")
            time.sleep(0.05)
    yield f"nats://127.0.0.1:{port}"
    proc.terminate()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


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
