"""The malloc thresholds every tandem process sets (services/common/malloc_tuning.py).

Each case runs in a child interpreter: thresholds cannot be unset, and the test process's
allocator should stay as pytest found it."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap

import pytest

from services.common.malloc_tuning import USER_SETTINGS

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")

# A thread holds four ~1 MiB buffers at once, touches and frees them, 30 rounds; prints
# whether the thresholds were set and the page faults of the last 20 rounds. This is the
# shape of a gRPC receive: C-core threads read each message into fresh buffers.
_CHURN = textwrap.dedent("""
    import ctypes, resource, threading
    from services.common.malloc_tuning import tune_malloc
    tuned = tune_malloc()
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)
    faults = {}
    def churn():
        for rnd in range(30):
            if rnd == 10:
                faults["start"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            bufs = [libc.malloc((1 << 20) + 4096 * (i % 3)) for i in range(4)]
            for b in bufs:
                ctypes.memset(b, 1, 1 << 20)
            for b in bufs:
                libc.free(b)
        faults["end"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = threading.Thread(target=churn)
    t.start()
    t.join()
    print(tuned, faults["end"] - faults["start"])
""")


def _churn(**env: str) -> tuple[bool, int]:
    base = {k: v for k, v in os.environ.items() if k != "TANDEM_MALLOC" and k not in USER_SETTINGS}
    out = subprocess.run([sys.executable, "-c", _CHURN], env={**base, **env}, capture_output=True,
                         text=True, check=True, timeout=60).stdout.split()
    return out[0] == "True", int(out[1])


def test_tuned_buffers_are_reused_without_faulting_pages_in_again() -> None:
    tuned, faults = _churn()
    assert tuned
    # NOTE: a few stray faults (Python's own allocations) are fine; 20 rounds of 4 MiB
    # faulting in afresh would be ~20,000.
    assert faults < 200


def test_the_glibc_defaults_fault_every_round_which_is_what_the_tuning_is_for() -> None:
    tuned, faults = _churn(TANDEM_MALLOC="system")
    assert not tuned
    assert faults > 20 * 256  # at least a quarter of the 4 MiB a round comes in as new pages


def test_a_users_own_malloc_settings_win() -> None:
    tuned, _ = _churn(GLIBC_TUNABLES="glibc.malloc.trim_threshold=1048576")
    assert not tuned
    tuned, _ = _churn(MALLOC_TRIM_THRESHOLD_="1048576")
    assert not tuned


def test_every_tandem_command_runs_tuned() -> None:
    """The CLI sets the thresholds before it hands over to any part or bench (a stand-in
    handler records whether they were set by then)."""
    code = textwrap.dedent("""
        import sys
        import services.cli as cli
        from services.common import malloc_tuning
        seen = []
        malloc_tuning.tune_malloc = lambda: seen.append("tuned") or True
        sys.modules["stand_in"] = type(sys)("stand_in")
        sys.modules["stand_in"].run = lambda args: seen.append("ran") or 0
        cli._HANDLERS[("router",)] = "stand_in:run"
        cli.main(["router", "-c", "x.yaml"])
        print(seen)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "['tuned', 'ran']", out.stderr
