"""Run a planned set of child processes: start, wait for readiness, watch, restart, stop.

Contract:
- Every child runs in its own process group (its own session), so a Ctrl-C at the terminal
  reaches only the launcher, which then stops the children in reverse start order: SIGTERM
  to the group, ``stop_timeout`` seconds to exit, then SIGKILL.
- A child's output goes to ``run_dir/logs/<name>.log`` and, when ``echo`` is on (a TTY),
  also to the terminal prefixed with its name. The last lines are kept for error reports.
- A child that dies (any exit the launcher did not ask for) is started again after a
  backoff (services/launcher/restart.py) while the others keep running; one line says so,
  another when it is ready again. With ``fail_fast`` a death stops everything instead.
- Decode and prefill workers can be scaled while it runs (``scale``, called from any thread:
  the planner's control endpoint): a missing replica starts in the lowest free slot of its
  part (its ports base + index, as plan.py assigns them); one over is drained, the highest
  index first: SIGTERM to its group, never restarted, forgotten once it exits (SIGKILL
  after ``drain_timeout``). The supervising thread alone starts and drains.
- ``run()`` returns 0 after a requested stop (SIGINT/SIGTERM or ``stop_event``), 1 when it
  gives up: a child died with ``fail_fast``, a child kept dying at start, or readiness
  timed out at start (after stopping the rest and saying which and why).
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from services.common import children
from services.launcher.metrics import LauncherMetrics
from services.launcher.nats import tcp_accepts
from services.launcher.plan import ProcessSpec, Readiness
from services.launcher.restart import RestartPolicy, RestartTracker

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
    """One run of a process: the first start or a restart."""

    spec: ProcessSpec
    proc: subprocess.Popen[bytes]
    started: float
    log_path: Path
    attempt: int = 0  # 0: the first start; n: the n-th restart
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=_TAIL_LINES))
    ready_at: float | None = None
    reader: threading.Thread | None = None


@dataclass
class _Slot:
    """One process of the plan across its restarts."""

    spec: ProcessSpec
    tracker: RestartTracker
    child: _Child
    restart_at: float | None = None  # set while it waits out a backoff
    scaled: bool = False  # started by ``scale`` while the cluster runs

    @property
    def ready(self) -> bool:
        return self.restart_at is None and self.child.ready_at is not None


@dataclass
class _Draining:
    """A replica told to stop for a scale-down: not restarted, killed at ``deadline``."""

    child: _Child
    deadline: float


SCALABLE_PARTS = ("decode", "prefill")


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
        policy: RestartPolicy | None = None,
        fail_fast: bool = False,
        metrics: LauncherMetrics | None = None,
        reserve: Sequence[ProcessSpec] = (),
        drain_timeout: float = 120.0,
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
        self.policy = policy if policy is not None else RestartPolicy()
        self.fail_fast = fail_fast
        self.metrics = metrics
        self.drain_timeout = drain_timeout
        self.stop_event = threading.Event()
        self._slots: list[_Slot] = []
        # every slot a scalable part may fill, in index order: the plan's, then the reserve's
        self._pool: dict[str, list[ProcessSpec]] = {
            part: [sp for sp in (*specs, *reserve) if sp.part == part] for part in SCALABLE_PARTS}
        self._draining: list[_Draining] = []
        self._desired: dict[str, int] = {}  # part -> replicas asked for, until reconciled
        self._scale_lock = threading.Lock()  # _slots' membership, _desired
        self._out_lock = threading.Lock()
        self._t0 = 0.0
        self._last_progress = 0.0

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

    def _spawn(self, spec: ProcessSpec, attempt: int) -> _Child:
        log_path = self.log_dir / f"{spec.name}.log"
        if attempt:
            # one log per process across restarts: mark where each run begins
            with log_path.open("a", encoding="utf-8") as log:
                log.write(f"----- tandem up: restart {attempt} of {spec.name} -----\n")
        proc = subprocess.Popen(
            list(spec.argv),
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            env={**os.environ, **spec.env},
            start_new_session=True,  # its own process group: we alone decide when it stops
        )
        child = _Child(spec, proc, time.monotonic(), log_path, attempt)
        child.reader = threading.Thread(target=self._pump, args=(child,), name=f"out-{spec.name}", daemon=True)
        child.reader.start()
        return child

    def _start(self, spec: ProcessSpec) -> _Slot:
        slot = _Slot(spec, RestartTracker(self.policy), self._spawn(spec, 0))
        with self._scale_lock:
            self._slots.append(slot)
        self._write_pids()
        self.say(f"starting {spec.name} (pid {slot.child.proc.pid})")
        return slot

    def _restart(self, slot: _Slot) -> None:
        slot.restart_at = None
        self._last_progress = time.monotonic()  # its first "waiting" line comes a while later
        slot.child = self._spawn(slot.spec, slot.tracker.restarts)
        self._write_pids()
        if self.metrics is not None:
            self.metrics.restarts.labels(slot.spec.name).inc()
        self.say(f"starting {slot.spec.name} (pid {slot.child.proc.pid}, restart {slot.child.attempt})")

    def _write_pids(self) -> None:
        data = [{"name": s.spec.name, "pid": s.child.proc.pid, "argv": list(s.spec.argv)}
                for s in self._slots]
        (self.run_dir / "processes.json").write_text(json.dumps(data, indent=1))

    def _say_tail(self, child: _Child) -> None:
        if child.tail:
            self.say(f"last lines of {child.spec.name} (full log: {child.log_path}):")
            for line in child.tail:
                self.say(f"  {line}")

    def _report_death(self, child: _Child) -> None:
        self.say(f"error: {child.spec.name} {describe_exit(child.proc.returncode)}; stopping the cluster")
        self._say_tail(child)

    def _set_up(self, name: str, up: bool) -> None:
        if self.metrics is not None:
            self.metrics.up.labels(name).set(1 if up else 0)

    def _on_death(self, slot: _Slot, now: float) -> int | None:
        """A child exited unasked: schedule its restart (None), or say why not (1)."""
        child = slot.child
        # Whatever it spawned would hold its ports against the restart (and its output pipe).
        children.kill_leftovers(child.proc)
        if child.reader is not None:
            child.reader.join(timeout=2.0)  # let the last lines arrive
        self._set_up(slot.spec.name, False)
        if self.fail_fast:
            self._report_death(child)
            return 1
        healthy_s = now - child.ready_at if child.ready_at is not None else 0.0
        d = slot.tracker.on_death(healthy_s)
        how = describe_exit(child.proc.returncode)
        if d.give_up and slot.scaled:
            # NOTE: a replica the planner added does not take the cluster down with it
            self.say(f"error: {slot.spec.name} {how}: {d.quick_failures} quick failures in a row; "
                     "giving it up (it was started by a scale, the cluster goes on without it)")
            self._say_tail(child)
            with self._scale_lock:
                self._slots.remove(slot)
            self._write_pids()
            return None
        if d.give_up:
            self.say(f"error: {slot.spec.name} {how}: {d.quick_failures} quick failures in a row "
                     f"(none stayed up {self.policy.stable_after_s:g} s), more than "
                     f"launcher.max_quick_restarts={self.policy.max_quick_restarts}; "
                     "giving up, stopping the cluster")
            self._say_tail(child)
            return 1
        self.say(f"restart  {slot.spec.name} {how} after {now - child.started:.1f} s; "
                 f"restart {d.attempt} in {d.delay_s:g} s")
        slot.restart_at = now + d.delay_s
        return None

    def _probe(self, slot: _Slot, now: float) -> None:
        child = slot.child
        if is_ready(child.spec.ready):
            child.ready_at = time.monotonic()
            took = child.ready_at - child.started
            again = f"after restart {child.attempt} " if child.attempt else ""
            self.say(f"ready    {child.spec.name:<12} {took:6.1f} s  {again}({child.spec.ready.describe()})")
            self._set_up(child.spec.name, True)
        elif (child.attempt or slot.scaled) and now - child.started > self.ready_timeout:
            # a restart (or a scaled start) that hangs is a failure like a crash: kill it,
            # the next tick restarts it
            after = f"restart {child.attempt}" if child.attempt else "its start"
            self.say(f"error: {child.spec.name} not ready {self.ready_timeout:g} s after {after}: killing it")
            children.signal_group(child.proc.pid, signal.SIGKILL)

    # -- scaling (the planner's local actuator) ---------------------------------------------

    def replicas(self) -> dict[str, int]:
        """Replicas of each scalable part running or starting (draining ones left out; a
        scale asked for and not yet carried out counts as done)."""
        with self._scale_lock:
            counts = {part: sum(1 for sl in self._slots if sl.spec.part == part) for part in SCALABLE_PARTS}
            return {**counts, **self._desired}

    def scale(self, counts: dict[str, int]) -> None:
        """Ask for ``counts[part]`` replicas of each part; the supervising thread starts or
        drains them at its next tick. ValueError (and nothing asked) when a part cannot be
        scaled or a count is out of range."""
        for part, n in counts.items():
            if part not in SCALABLE_PARTS:
                raise ValueError(f"{part} cannot be scaled (only {', '.join(SCALABLE_PARTS)})")
            slots = len(self._pool[part])
            if not 0 <= n <= slots:
                raise ValueError(f"{part}: {n} replicas asked, {slots} slots planned "
                                 f"(planner.max_{part} and the configured replicas)")
        with self._scale_lock:
            self._desired.update(counts)

    def _reconcile(self) -> None:
        """Start or drain replicas until each part has what ``scale`` asked for."""
        with self._scale_lock:
            desired, self._desired = self._desired, {}
        for part, n in desired.items():
            live = [sl for sl in self._slots if sl.spec.part == part]
            busy = {sl.spec.name for sl in live} | {d.child.spec.name for d in self._draining}
            free = [sp for sp in self._pool[part] if sp.name not in busy]
            for spec in free[:max(0, n - len(live))]:
                self._start(spec).scaled = True
            order = {sp.name: i for i, sp in enumerate(self._pool[part])}
            for sl in sorted(live, key=lambda sl: order[sl.spec.name])[n:]:
                self._drain(sl)

    def _drain(self, slot: _Slot) -> None:
        with self._scale_lock:
            self._slots.remove(slot)
        self._write_pids()
        child = slot.child
        self._set_up(slot.spec.name, False)
        if slot.restart_at is not None or child.proc.poll() is not None:
            self.say(f"removed  {slot.spec.name} (it was not running)")
            return
        children.signal_group(child.proc.pid, slot.spec.stop_signal)
        self._draining.append(_Draining(child, time.monotonic() + self.drain_timeout))
        self.say(f"draining {slot.spec.name} (pid {child.proc.pid})")

    def _reap_drained(self) -> None:
        for d in list(self._draining):
            c = d.child
            if c.proc.poll() is None:
                if time.monotonic() < d.deadline:
                    continue
                self.say(f"{c.spec.name} not drained in {self.drain_timeout:g} s: killing it")
                children.signal_group(c.proc.pid, signal.SIGKILL)
                c.proc.wait()
            children.kill_leftovers(c.proc)  # what it left in its group
            if c.reader is not None:
                c.reader.join(timeout=2.0)
            self._draining.remove(d)
            self.say(f"drained  {c.spec.name} ({describe_exit(c.proc.returncode)})")

    def _tick(self) -> int | None:
        """One round over every process: deaths, restarts due, readiness. None, or the exit
        status ``run`` should return (after the caller stops everything)."""
        for slot in list(self._slots):  # a scaled replica given up leaves it
            if self.stop_event.is_set():
                return 0
            now = time.monotonic()
            if slot.restart_at is not None:
                if now >= slot.restart_at:
                    self._restart(slot)
                continue
            if slot.child.proc.poll() is not None:
                status = self._on_death(slot, now)
                if status is not None:
                    return status
            elif slot.child.ready_at is None:
                self._probe(slot, now)
        return None

    def _progress(self) -> None:
        """Every so often, who is still not ready (and for how long)."""
        now = time.monotonic()
        if now - self._last_progress < _PROGRESS_EVERY_S:
            return
        self._last_progress = now
        pending = [s for s in self._slots if not s.ready]
        if pending:
            waiting = ", ".join(
                f"{s.spec.name} (restart {s.tracker.restarts} in "
                f"{max(0.0, s.restart_at - now):.0f} s)" if s.restart_at is not None else
                f"{s.spec.name} ({now - s.child.started:.0f} s"
                + (f", restart {s.child.attempt})" if s.child.attempt else ")")
                for s in pending)
            self.say(f"waiting  for {waiting}")

    def _wait_ready(self, slots: list[_Slot], deadline: float) -> int | None:
        """Run ticks until every slot in ``slots`` is ready. None when they are; else the
        exit status ``run`` should return."""
        self._last_progress = time.monotonic()
        while True:
            status = self._tick()
            if status is not None:
                return status
            if self.stop_event.is_set():
                return 0
            pending = [s for s in slots if not s.ready]
            if not pending:
                return None
            if time.monotonic() > deadline:
                names = ", ".join(s.spec.name for s in pending)
                self.say(f"error: not ready after {self.ready_timeout:g} s: {names} "
                         f"(logs in {self.log_dir}; raise --ready-timeout if models load slowly)")
                return 1
            self._progress()
            self.stop_event.wait(self.poll_s)

    def _supervise(self) -> int:
        while not self.stop_event.is_set():
            self._reconcile()
            self._reap_drained()
            status = self._tick()
            if status is not None:
                return status
            self._progress()
            self.stop_event.wait(self.poll_s)
        return 0

    def stop_all(self) -> None:
        """Stop children in reverse start order, one part at a time (replicas together);
        replicas still draining get ``stop_timeout`` more, then SIGKILL."""
        for d in self._draining:
            d.deadline = min(d.deadline, time.monotonic() + self.stop_timeout)
        while self._draining:
            self._reap_drained()
            time.sleep(self.poll_s)
        groups: list[list[_Child]] = []
        for slot in reversed(self._slots):
            c = slot.child
            if groups and groups[-1][0].spec.part == c.spec.part:
                groups[-1].append(c)
            else:
                groups.append([c])
        for group in groups:
            for c in group:
                if c.proc.poll() is None:
                    children.signal_group(c.proc.pid, c.spec.stop_signal)
            deadline = time.monotonic() + self.stop_timeout
            for c in group:
                try:
                    c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    self.say(f"{c.spec.name} did not stop in {self.stop_timeout:g} s: killing it")
                    children.signal_group(c.proc.pid, signal.SIGKILL)
                    c.proc.wait()
                # Anything the child left behind in its group goes too.
                children.kill_leftovers(c.proc)
                self._set_up(c.spec.name, False)
                self.say(f"stopped  {c.spec.name} ({describe_exit(c.proc.returncode)})")
        for slot in self._slots:
            if slot.child.reader is not None:
                slot.child.reader.join(timeout=2.0)

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
        batch: list[_Slot] = []
        for spec in self.specs:
            if self.stop_event.is_set():
                return 0
            batch.append(self._start(spec))
            if spec.barrier:
                status = self._wait_ready(batch, deadline)
                if status is not None:
                    return status
                batch = []
        return self._wait_ready(self._slots, deadline)

