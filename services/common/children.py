"""Child processes that end with the command that started them.

A command that starts a cluster (`tandem bench compare`, a bench with ``--up``, a test
fixture) must stop it when it is itself terminated: SIGTERM's default action (what
``timeout`` and ``kill`` send) ends the process without running a single ``finally``, and
a child left behind keeps holding its ports. So ``spawn``:

- starts the child in its own session: the child's whole tree is one process group that
  ``stop`` can end, and a Ctrl-C at the terminal reaches only the command, which then stops
  the child itself, in order;
- makes SIGTERM raise KeyboardInterrupt in this process, as SIGINT does, so the ``finally``
  blocks that stop children run (`tandem` answers it with exit status 130);
- remembers the child until ``stop`` has ended it, and stops what is left at exit: a second
  signal that cut a ``finally`` short still leaves nothing running.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class _Stop:
    timeout_s: float
    # process groups a forced stop leaves behind: a supervisor's children run in sessions
    # of their own, so SIGKILL to the supervisor does not reach them
    orphans: Callable[[], Iterable[int]] | None


_running: dict[subprocess.Popen, _Stop] = {}


def interrupt_on_sigterm() -> None:
    """SIGTERM raises KeyboardInterrupt in the main thread from now on, unless something
    else has claimed SIGTERM already (its handler is no longer the default)."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _interrupt)


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def spawn(argv: Sequence[str], *, stop_timeout_s: float = 10.0,
          orphans: Callable[[], Iterable[int]] | None = None, **popen: Any) -> subprocess.Popen:
    """``subprocess.Popen(argv, **popen)`` in a session of its own, stopped by ``stop`` (or
    at exit) with SIGTERM and ``stop_timeout_s`` to exit before SIGKILL; ``orphans`` names
    the process groups to SIGKILL as well when it had to be killed."""
    interrupt_on_sigterm()
    proc = subprocess.Popen(list(argv), start_new_session=True, **popen)
    _running[proc] = _Stop(stop_timeout_s, orphans)
    return proc


def stop(proc: subprocess.Popen, timeout_s: float | None = None,
         sig: signal.Signals = signal.SIGTERM) -> int:
    """``sig`` to ``proc``, up to ``timeout_s`` (default: ``spawn``'s) for it to exit, then
    SIGKILL; whatever else is left in its process group (and, after a SIGKILL, its
    ``orphans``) is SIGKILLed too. Returns its exit status."""
    how = _running.get(proc, _Stop(10.0, None))
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(how.timeout_s if timeout_s is None else timeout_s)
        except subprocess.TimeoutExpired:
            signal_group(proc.pid, signal.SIGKILL)
            proc.wait()
            for pgid in how.orphans() if how.orphans is not None else ():
                signal_group(pgid, signal.SIGKILL)
    kill_leftovers(proc)
    _running.pop(proc, None)
    return proc.returncode


def kill_leftovers(proc: subprocess.Popen) -> None:
    """SIGKILL whatever the exited (reaped) ``proc``, started in a session of its own, left
    in its process group.

    The group's id is ``proc``'s pid, and the kernel does not give that number to a new
    process while the group has members. So a live process with that pid means the group is
    empty and the number is someone else's now (pids wrap at 32768 on many machines, and
    torch's threads use them up fast): that process, a session leader perhaps (a test's
    nats-server), is left alone.
    """
    if not _pid_in_use(proc.pid):
        signal_group(proc.pid, signal.SIGKILL)


def _pid_in_use(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # no signal: only whether the pid exists (EPERM: it does)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def signal_group(pgid: int, sig: signal.Signals) -> None:
    """``sig`` to every process in group ``pgid``; a group already gone is no error."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


@atexit.register
def _stop_all() -> None:
    for proc in list(_running):
        # NOTE: one reaped long ago is left alone: its pid, and so its group id, may be
        # another process's by now
        if proc.poll() is None:
            stop(proc)
