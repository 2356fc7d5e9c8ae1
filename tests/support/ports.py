"""Free TCP ports on loopback for tests that start servers."""

from __future__ import annotations

import random
import socket
from collections import deque
from pathlib import Path

# Ports handed out lately in this process: a test that takes several ports for one config
# (router, its metrics, the launcher's ...) must not plan one port twice.
_recent: deque[int] = deque(maxlen=4096)


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


# NOTE: below the kernel's ephemeral range. A port the kernel handed out for a probe bind is
# one it hands out again as the source port of the next outgoing connection; a cluster that
# starts opens dozens (gRPC channels, NATS clients), and one of them took a planned listen
# port between the probe and the server's bind (CI, `cannot bind gRPC port`). Ports below
# the range are only ever taken by something that asks for them by number.
_LOW = 20000
_HIGH = max(_LOW + 1000, min(_ephemeral_low(), 65536)) - 1
_rng = random.Random()


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_run(n: int) -> int:
    """A port p with p .. p + n - 1 all free and not handed out lately by this process
    (decode replica i listens on port + i)."""
    for _ in range(1000):
        p = _rng.randrange(_LOW, _HIGH - n + 2)
        run = range(p, p + n)
        if any(q in _recent for q in run) or not all(_bindable(q) for q in run):
            continue
        _recent.extend(run)
        return p
    raise AssertionError(f"no {n} consecutive free ports in {_LOW}..{_HIGH}")


def free_port() -> int:
    """A port nothing listens on right now, outside the ephemeral range, and not handed out
    lately by this process (a race with another process asking for it by number is
    possible but rare)."""
    return free_run(1)


def free_port_pair() -> int:
    """A port p with p + 1 also free (decode replica i listens on port + i)."""
    return free_run(2)
