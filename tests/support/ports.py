"""Free TCP ports on loopback for tests that start servers."""

from __future__ import annotations

import socket
from collections import deque

# Ports handed out lately in this process: the kernel may pick a released port again at
# once, and a test that takes several ports for one config (router, its metrics, the
# launcher's ...) would then plan one port twice.
_recent: deque[int] = deque(maxlen=4096)


def free_port() -> int:
    """A port nothing listens on right now and not handed out lately by this process (the
    OS picks it; a race with another process is possible but rare)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _recent:
            _recent.append(port)
            return port
    raise AssertionError("the kernel keeps handing out ports this process used lately")


def free_port_pair() -> int:
    """A port p with p + 1 also free (decode replica i listens on port + i)."""
    for _ in range(50):
        p = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p + 1))
            except OSError:
                continue
        return p
    raise AssertionError("no two consecutive free ports")
