"""``children.kill_leftovers``: what an exited child left in its process group is killed;
a process that now holds the child's old pid (pids wrap) is not."""

from __future__ import annotations

import subprocess
import time
from types import SimpleNamespace

from services.common import children


def _gone(pid: int, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            state = open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[0]
        except FileNotFoundError:
            return True
        if state == "Z":
            return True
        time.sleep(0.02)
    return False


def test_an_exited_childs_group_members_are_killed() -> None:
    # the shell exits at once, leaving its sleep behind in the group the shell led
    proc = subprocess.Popen(["sh", "-c", "sleep 60 & echo $!"], stdout=subprocess.PIPE,
                            start_new_session=True, text=True)
    left = int(proc.stdout.readline())
    proc.wait()
    proc.stdout.close()
    assert not _gone(left, 0.2)
    children.kill_leftovers(proc)
    assert _gone(left)


def test_a_process_now_holding_the_old_pid_is_left_alone() -> None:
    # stands for a new session leader that got the pid of a child reaped long ago
    other = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        children.kill_leftovers(SimpleNamespace(pid=other.pid))
        assert other.poll() is None and not _gone(other.pid, 0.3)
    finally:
        other.kill()
        other.wait()
