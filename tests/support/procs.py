"""Real processes for the integration tests: a nats-server that can be killed and restarted
on the same port and store dir, and `tandem <part>` processes run from a config file, each
with its output in a log file that failure messages quote. Each runs in a session of its own
and is stopped when the test run is itself terminated (services/common/children.py)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import yaml

from services.common import children
from services.common.config import ClusterConfig
from services.common.env import in_ci
from services.launcher.nats import NatsServerNotFoundError, find_nats_server, tcp_accepts
from services.router.router import Router
from tests.support.ports import free_port

REPO = Path(__file__).resolve().parents[2]


def _wait_port(port: int, proc: subprocess.Popen, timeout: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not tcp_accepts("127.0.0.1", port):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            tail = log.read_text(errors="replace")[-2000:]
            raise AssertionError(f"{what} did not listen on {port}: {tail}")
        time.sleep(0.05)


def needs_nats_server() -> None:
    """Skip the test when nats-server is not installed; under CI, fail it instead."""
    try:
        find_nats_server()
    except NatsServerNotFoundError as e:
        if in_ci():
            pytest.fail(f"CI must have nats-server: {e}")
        pytest.skip(str(e))


@dataclass
class NatsServer:
    """``start``/``kill``/``start`` again: same port, same JetStream store dir, so streams,
    consumers and KV buckets survive the restart. ``args`` go to nats-server as they are
    (``--user``/``--pass``, ``--auth``); its output is in ``store/nats-server.log``."""

    store: Path
    args: tuple[str, ...] = ()
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        log = self.store / "nats-server.log"
        self.store.mkdir(parents=True, exist_ok=True)
        with log.open("a") as out:
            self.proc = children.spawn(
                [find_nats_server(), "-js", "-a", "127.0.0.1", "-p", str(self.port),
                 "-sd", str(self.store), *self.args],
                stop_timeout_s=5, stdout=out, stderr=subprocess.STDOUT)
        _wait_port(self.port, self.proc, 10, "nats-server", log)

    def kill(self) -> None:
        if self.proc is not None:
            children.stop(self.proc, 10, signal.SIGKILL)
        self.proc = None

    def died(self) -> str | None:
        """None while it runs (or was stopped on purpose); else how it ended and the end of
        its log: a server gone mid-test shows up as clients' timeouts elsewhere."""
        if self.proc is None or self.proc.poll() is None:
            return None
        log = (self.store / "nats-server.log").read_text(errors="replace")[-2000:]
        return f"nats-server on port {self.port} exited ({self.proc.returncode}):\n{log}"

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it is still up after 5 s."""
        if self.proc is not None:
            children.stop(self.proc, 5)
        self.proc = None


def write_config(cfg: ClusterConfig, path: Path) -> Path:
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    return path


@dataclass
class Part:
    """One `tandem <part> -c FILE --replica N` process; its output goes to ``log``."""

    name: str
    proc: subprocess.Popen
    log: Path

    def alive(self) -> bool:
        return self.proc.poll() is None

    def output(self, tail: int | None = 3000) -> str:
        """The end of its log (all of it with ``tail=None``)."""
        text = self.log.read_text(errors="replace")
        return text if tail is None else text[-tail:]

    def assert_alive(self) -> None:
        """AssertionError with the exit status and the end of the log if it has exited."""
        if not self.alive():
            raise AssertionError(f"{self.name} died (exit {self.proc.returncode}): {self.output()}")

    def terminate(self) -> None:
        """SIGTERM (the part's cue to drain and exit 0) without waiting."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int | None:
        """The exit status, or None if it is still running after ``timeout`` seconds."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill9(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self, timeout: float = 20) -> int:
        """SIGTERM and the exit status; SIGKILL (status -9) after ``timeout`` seconds."""
        return children.stop(self.proc, timeout)


def start_part(part: str, cfg_file: Path, log_dir: Path, replica: int = 0,
               args: Sequence[str] = ()) -> Part:
    """`tandem <part> -c cfg_file --replica N [args...]`, its output in
    ``log_dir/<part>-<replica>.log``; returns at once (readiness is the caller's to check)."""
    log = log_dir / f"{part}-{replica}.log"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with log.open("w") as out:
        proc = children.spawn(
            [sys.executable, "-m", "services.cli", part, "-c", str(cfg_file), "--replica", str(replica),
             *args],
            stop_timeout_s=20, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    return Part(f"{part}-{replica}", proc, log)


def stop_parts(parts: Sequence[Part], timeout: float = 30) -> dict[str, int]:
    """SIGTERM every part at once (they drain concurrently), then each one's exit status by
    name; one still running after ``timeout`` is SIGKILLed (status -9)."""
    for p in parts:
        p.terminate()
    deadline = time.monotonic() + timeout
    codes: dict[str, int] = {}
    for p in parts:
        # NOTE: wait, do not signal again: a second SIGTERM that lands after a part's event
        # loop has closed (its interpreter tearing down, slow on a loaded machine) kills it
        # by the default action, -15, where it was exiting cleanly (seen in CI)
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.proc.wait(max(0.0, deadline - time.monotonic()))
        codes[p.name] = children.stop(p.proc, 0.0)  # exited: its status; else SIGKILL (-9)
    return codes


def wait_http_ok(url: str, parts: Sequence[Part], timeout: float = 60) -> httpx.Response:
    """GET ``url`` until it answers 200 and return that response; AssertionError (with the
    log) as soon as one of ``parts`` dies, or after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in parts:
            p.assert_alive()
        try:
            r = httpx.get(url, timeout=2)
            if r.status_code == 200:
                return r
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} never answered 200 in {timeout:g} s")


@asynccontextmanager
async def decode_procs(cfg: ClusterConfig, tmp_path: Path, n: int = 2) -> AsyncIterator[list[Part]]:
    """``n`` `tandem decode` processes on ``cfg``, SIGKILLed on exit."""
    cfg_file = write_config(cfg, tmp_path / "cluster.yaml")
    parts = [start_part("decode", cfg_file, tmp_path, replica=i) for i in range(n)]
    try:
        yield parts
    finally:
        for p in parts:
            p.kill9()


async def wait_workers(router: Router, ids: set[str], parts: Sequence[Part], timeout: float = 60) -> None:
    """Until ``router`` knows every worker in ``ids``; fails at once when one of them died."""
    deadline = time.monotonic() + timeout
    while not ids <= set(router.workers):
        for p in parts:
            assert p.alive() or p.name not in ids, f"{p.name} died: {p.output()}"
        assert time.monotonic() < deadline, f"workers never registered: {set(router.workers)}"
        await asyncio.sleep(0.1)
