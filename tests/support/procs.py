"""Real processes for the fault tests: a nats-server that can be killed and restarted on the
same port and store dir, and `tandem <part>` processes run from a config file."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from services.common.config import ClusterConfig
from tests.support.ports import free_port

REPO = Path(__file__).resolve().parents[2]



def _wait_port(port: int, proc: subprocess.Popen, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise AssertionError(f"{what} did not listen on {port}") from None
            time.sleep(0.05)


@dataclass
class NatsServer:
    """``start``/``kill``/``start`` again: same port, same JetStream store dir, so streams,
    consumers and KV buckets survive the restart."""

    store: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        binary = shutil.which("nats-server") or "/usr/sbin/nats-server"
        self.proc = subprocess.Popen(
            [binary, "-js", "-a", "127.0.0.1", "-p", str(self.port), "-sd", str(self.store)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_port(self.port, self.proc, 10, "nats-server")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
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

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def kill9(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self, timeout: float = 20) -> int:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_part(part: str, cfg_file: Path, log_dir: Path, replica: int = 0) -> Part:
    log = log_dir / f"{part}-{replica}.log"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", part, "-c", str(cfg_file), "--replica", str(replica)],
        cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    return Part(f"{part}-{replica}", proc, log)
