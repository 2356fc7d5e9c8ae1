"""`tandem up` as a real subprocess for the tests: its output in a file the test polls for
lines, its children's pids from the run directory, a /live poller that records every
failure while a test breaks something."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from services.bench.cluster import wait_healthy
from services.common import children
from tests.support.ports import free_port

REPO = Path(__file__).resolve().parents[2]
PORT_NAMES = ("nats", "router", "router_m", "decode", "decode_m", "prefill_m", "proc", "proc_m",
              "front", "launcher_m")
# The README's question.
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
# Long enough (~500 tokens) to pass decode.disagg.max_local_prefill_length (256).
LONG = [{"role": "user", "content": "Summarise: " + "The Roman Empire built roads, aqueducts "
         "and cities across Europe, and its law shaped later states. " * 30}]


@dataclass
class Up:
    proc: subprocess.Popen
    run_dir: Path
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout: float = 120) -> re.Match[str]:
        """The first match of the regex ``pattern`` in the output; AssertionError (with the
        output) if `tandem up` exits first or after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            m = re.search(pattern, self.output(), re.MULTILINE)
            if m:
                return m
            if self.proc.poll() is not None:
                raise AssertionError(f"tandem up exited {self.proc.returncode} before "
                                     f"{pattern!r}:\n{self.output()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{pattern!r} not printed in {timeout:g} s:\n{self.output()}")
            time.sleep(0.1)

    def wait_healthy(self, base: str, timeout: float = 300) -> None:
        """Until the frontend at ``base`` answers /health with 200; AssertionError (with the
        output) if `tandem up` exits first or after ``timeout`` seconds."""
        try:
            wait_healthy(base, self.proc, timeout)
        except RuntimeError as e:
            raise AssertionError(f"{e}:\n{self.output()}") from None

    def pids(self) -> dict[str, int]:
        return {p["name"]: p["pid"] for p in json.loads((self.run_dir / "processes.json").read_text())}

    def wait(self, timeout: float) -> int:
        """The exit status; SIGKILL to its whole group after ``timeout`` seconds."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise AssertionError(f"tandem up still running after {timeout:g} s:\n{self.output()}") from None

    def stop(self, timeout: float = 90) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.wait(timeout)


def start_up(config: Path, run_dir: Path, args: Sequence[str] = (), overrides: Sequence[str] = ()) -> Up:
    """`tandem up -c config --run-dir run_dir [args...] [--set override ...]` (with
    ``decode.disagg.policy=threshold`` first), output in
    ``run_dir.parent/up.log``. Its own session, so a test can end it and everything under it
    with one killpg; stopped, its parts included, when the test run is terminated."""
    log = run_dir.parent / f"{run_dir.name}-up.log"
    # NOTE: the remote path's tests want a long prompt remote whenever allowed (a later
    # --set of the key wins)
    overrides = ["decode.disagg.policy=threshold", *overrides]
    argv = [sys.executable, "-m", "services.cli", "up", "-c", str(config), "--run-dir", str(run_dir),
            *args, *(a for o in overrides for a in ("--set", o))]
    with log.open("w") as out:
        proc = children.spawn(argv, stop_timeout_s=90, orphans=lambda: _pids(run_dir), cwd=REPO,
                              env={**os.environ, "PYTHONPATH": str(REPO)},
                              stdout=out, stderr=subprocess.STDOUT)
    return Up(proc, run_dir, log)


def _pids(run_dir: Path) -> list[int]:
    try:
        return [p["pid"] for p in json.loads((run_dir / "processes.json").read_text())]
    except (OSError, ValueError):
        return []


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@dataclass
class LivePoller:
    """GETs ``url`` every ``every_s`` in a thread while in the ``with`` block; ``failures``
    lists what did not answer 200."""

    url: str
    every_s: float = 0.1
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def _run(self) -> None:
        with httpx.Client(timeout=2) as client:
            while not self._stop.is_set():
                try:
                    r = client.get(self.url)
                    if r.status_code == 200:
                        self.ok += 1
                    else:
                        self.failures.append(f"{r.status_code} {r.text[:200]}")
                except httpx.HTTPError as e:
                    self.failures.append(f"{type(e).__name__}: {e}")
                self._stop.wait(self.every_s)

    def __enter__(self) -> LivePoller:
        self._thread = threading.Thread(target=self._run, name="live-poller", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)


def metric(url: str, name: str) -> float:
    """The sample ``name`` (with its labels, as printed) of the /metrics at ``url``."""
    for line in httpx.get(url, timeout=10).text.splitlines():
        key, _, value = line.rpartition(" ")
        if key == name:
            return float(value)
    raise AssertionError(f"{name} not in {url}")


def launcher_metric(port: int, name: str, part: str) -> float:
    """One labelled sample of the launcher's /metrics."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    m = re.search(rf'^{re.escape(name)}{{part="{re.escape(part)}"}} ([0-9.e+-]+)$', text, re.MULTILINE)
    if m is None:
        raise AssertionError(f'{name}{{part="{part}"}} not in the launcher\'s /metrics:\n{text}')
    return float(m.group(1))


def nats_login(run_dir: Path, user: str = "frontend") -> dict[str, str]:
    """``user``'s NATS credentials in a `tandem up` run (the embedded nats-server requires a
    user per process: RUN_DIR/nats-server.conf), as NatsConfig fields."""
    text = (run_dir / "nats-server.conf").read_text()
    m = re.search(r'\{user: "' + re.escape(user) + r'", password: ("(?:[^"\\]|\\.)*")', text)
    assert m, f"no user {user!r} in {run_dir / 'nats-server.conf'}"
    return {"user": user, "password": json.loads(m.group(1))}


def local_ports() -> tuple[dict[str, int], list[str]]:
    """Free ports for configs/local.yaml's parts (``PORT_NAMES``) and the ``--set``
    overrides that put each part on its own, so several clusters never collide."""
    p = {k: free_port() for k in PORT_NAMES}
    return p, [
        f"nats.url=nats://127.0.0.1:{p['nats']}", f"router.port={p['router']}",
        f"router.metrics_port={p['router_m']}", f"decode.port={p['decode']}",
        f"decode.metrics_port={p['decode_m']}", f"prefill.metrics_port={p['prefill_m']}",
        f"processor.port={p['proc']}", f"processor.metrics_port={p['proc_m']}",
        f"frontend.port={p['front']}", f"launcher.metrics_port={p['launcher_m']}",
    ]
