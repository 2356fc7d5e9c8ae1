"""Run a planned set of child processes: start, wait for readiness, watch, stop.

Contract:
- Every child runs in its own process group (its own session), so a Ctrl-C at the terminal
  reaches only the launcher, which then stops the children in reverse start order: SIGTERM
  to the group, ``stop_timeout`` seconds to exit, then SIGKILL.
- A child's output goes to ``run_dir/logs/<name>.log`` and, when ``echo`` is on (a TTY),
  also to the terminal prefixed with its name. The last lines are kept for error reports.
- ``run()`` returns 0 after a requested stop (SIGINT/SIGTERM or ``stop_event``), 1 when a
  child dies or readiness times out (after stopping the rest and saying which and why).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from services.launcher.nats import tcp_accepts
from services.launcher.plan import ProcessSpec, Readiness

_TAIL_LINES = 30
_PROGRESS_EVERY_S = 10.0


def is_ready(r: Readiness) -> bool:
    """One readiness probe: TCP accept, or HTTP GET answering 200."""
    if r.kind == "tcp":
        return tcp_accepts(r.host, r.port)
    try:
        with urllib.request.urlopen(f"http://{r.host}:{r.port}{r.path}", timeout=1.0) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


@dataclass
class _Child:
    spec: ProcessSpec
    proc: subprocess.Popen[bytes]
    started: float
    log_path: Path
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=_TAIL_LINES))
    ready_at: float | None = None
    reader: threading.Thread | None = None


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class Supervisor:
    def __init__(
        self,
        specs: list[ProcessSpec],
        run_dir: Path,
        *,
        out: IO[str],
        echo: bool = False,
        ready_timeout: float = 600.0,
        stop_timeout: float = 10.0,
        poll_s: float = 0.2,
        banner: Callable[[float], str] | None = None,
    ) -> None:
        if not specs:
            raise ValueError("nothing to start: the plan is empty")
        self.specs = specs
        self.run_dir = run_dir
        self.log_dir = run_dir / "logs"
        self.out = out
        self.echo = echo
        self.ready_timeout = ready_timeout
        self.stop_timeout = stop_timeout
        self.poll_s = poll_s
        self.banner = banner
        self.stop_event = threading.Event()
        self._children: list[_Child] = []
        self._out_lock = threading.Lock()
        self._t0 = 0.0

    # -- output ---------------------------------------------------------------------------

    def say(self, line: str) -> None:
        with self._out_lock:
            self.out.write(line + "\n")
            self.out.flush()

    def _pump(self, child: _Child) -> None:
        """Copy a child's output to its log (and the terminal), keeping the last lines."""
        assert child.proc.stdout is not None
        width = max(len(s.name) for s in self.specs)
        with child.log_path.open("a", encoding="utf-8") as log:
            for raw in child.proc.stdout:
                line = raw.decode("utf-8", errors="replace").rstrip("\n")
                child.tail.append(line)
                log.write(line + "\n")
                log.flush()
                if self.echo:
                    self.say(f"{child.spec.name:<{width}} | {line}")

    # -- lifecycle -----------------------------------------------------------------------

    def _start(self, spec: ProcessSpec) -> _Child:
        log_path = self.log_dir / f"{spec.name}.log"
        proc = subprocess.Popen(
            list(spec.argv),
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            env={**os.environ, **spec.env},
            start_new_session=True,  # its own process group: we alone decide when it stops
        )
        child = _Child(spec, proc, time.monotonic(), log_path)
        child.reader = threading.Thread(target=self._pump, args=(child,), name=f"out-{spec.name}", daemon=True)
        child.reader.start()
        self._children.append(child)
        self._write_pids()
        self.say(f"starting {spec.name} (pid {proc.pid})")
        return child

    def _write_pids(self) -> None:
        data = [{"name": c.spec.name, "pid": c.proc.pid, "argv": list(c.spec.argv)} for c in self._children]
        (self.run_dir / "processes.json").write_text(json.dumps(data, indent=1))

    def _dead_child(self) -> _Child | None:
        for c in self._children:
            if c.proc.poll() is not None:
                return c
        return None

    def _report_death(self, child: _Child) -> None:
        code = child.proc.returncode
        if child.reader is not None:
            child.reader.join(timeout=2.0)  # let the last lines arrive
        self.say(f"error: {child.spec.name} {describe_exit(code)}; stopping the cluster")
        if child.tail:
            self.say(f"last lines of {child.spec.name} (full log: {child.log_path}):")
            for line in child.tail:
                self.say(f"  {line}")

    def _wait_ready(self, children: list[_Child], deadline: float) -> int | None:
        """Poll until every child in ``children`` is ready. None when they are; else the
        exit status ``run`` should return (after the caller stops everything)."""
        last_progress = time.monotonic()
        while True:
            if self.stop_event.is_set():
                return 0
            dead = self._dead_child()
            if dead is not None:
                self._report_death(dead)
                return 1
            pending = [c for c in children if c.ready_at is None]
            for c in pending:
                if is_ready(c.spec.ready):
                    c.ready_at = time.monotonic()
                    self.say(f"ready    {c.spec.name:<12} {c.ready_at - c.started:6.1f} s  "
                             f"({c.spec.ready.describe()})")
            pending = [c for c in pending if c.ready_at is None]
            if not pending:
                return None
            now = time.monotonic()
            if now > deadline:
                names = ", ".join(c.spec.name for c in pending)
                self.say(f"error: not ready after {self.ready_timeout:g} s: {names} "
                         f"(logs in {self.log_dir}; raise --ready-timeout if models load slowly)")
                return 1
            if now - last_progress >= _PROGRESS_EVERY_S:
                last_progress = now
                waiting = ", ".join(f"{c.spec.name} ({now - c.started:.0f} s)" for c in pending)
                self.say(f"waiting  for {waiting}")
            self.stop_event.wait(self.poll_s)

    def _supervise(self) -> int:
        while not self.stop_event.is_set():
            dead = self._dead_child()
            if dead is not None:
                self._report_death(dead)
                return 1
            self.stop_event.wait(self.poll_s)
        return 0

    def stop_all(self) -> None:
        """Stop children in reverse start order, one part at a time (replicas together)."""
        groups: list[list[_Child]] = []
        for c in reversed(self._children):
            if groups and groups[-1][0].spec.part == c.spec.part:
                groups[-1].append(c)
            else:
                groups.append([c])
        for group in groups:
            for c in group:
                if c.proc.poll() is None:
                    _signal_group(c.proc.pid, c.spec.stop_signal)
            deadline = time.monotonic() + self.stop_timeout
            for c in group:
                try:
                    c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    self.say(f"{c.spec.name} did not stop in {self.stop_timeout:g} s: killing it")
                    _signal_group(c.proc.pid, signal.SIGKILL)
                    c.proc.wait()
                # Anything the child left behind in its group goes too.
                _signal_group(c.proc.pid, signal.SIGKILL)
                self.say(f"stopped  {c.spec.name} ({describe_exit(c.proc.returncode)})")
        for c in self._children:
            if c.reader is not None:
                c.reader.join(timeout=2.0)

    def run(self, install_signals: bool = True) -> int:
        """Start everything, wait for readiness, print the banner, supervise, stop."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        previous = {}
        if install_signals:
            for sig in (signal.SIGINT, signal.SIGTERM):
                previous[sig] = signal.signal(sig, lambda *_: self.stop_event.set())
        self._t0 = time.monotonic()
        deadline = self._t0 + self.ready_timeout
        try:
            status = self._start_all(deadline)
            if status is None:
                if self.banner is not None:
                    self.say(self.banner(time.monotonic() - self._t0))
                status = self._supervise()
            if self.stop_event.is_set() and status == 0:
                self.say("stopping (signal received)")
            return status
        finally:
            self.stop_all()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _start_all(self, deadline: float) -> int | None:
        batch: list[_Child] = []
        for spec in self.specs:
            if self.stop_event.is_set():
                return 0
            batch.append(self._start(spec))
            if spec.barrier:
                status = self._wait_ready(batch, deadline)
                if status is not None:
                    return status
                batch = []
        return self._wait_ready(self._children, deadline)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
