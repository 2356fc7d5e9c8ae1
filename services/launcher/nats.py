"""The embedded nats-server: where it listens, how it is started, when it is up."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path
from urllib.parse import urlparse

_DEFAULT_PORT = 4222
_FALLBACK_BINARY = Path("/usr/sbin/nats-server")


class NatsServerNotFoundError(RuntimeError):
    """No ``nats-server`` binary on PATH (``make nats`` installs it)."""


def nats_endpoint(url: str) -> tuple[str, int]:
    """``nats://host:port`` -> (host, port); the port defaults to 4222.

    Raises ValueError naming ``nats.url`` for anything that is not a single nats:// URL.
    """
    parsed = urlparse(url)
    if parsed.scheme not in ("nats", "tls") or not parsed.hostname or "," in url:
        raise ValueError(f"nats.url must look like nats://host:port, got {url!r}")
    try:
        port = parsed.port or _DEFAULT_PORT
    except ValueError:
        raise ValueError(f"nats.url has a bad port: {url!r}") from None
    return parsed.hostname, port


def find_nats_server() -> str:
    """Path of the nats-server binary, or NatsServerNotFoundError with the fix."""
    found = shutil.which("nats-server")
    if found:
        return found
    if _FALLBACK_BINARY.exists():
        return str(_FALLBACK_BINARY)
    raise NatsServerNotFoundError(
        "nats-server is not installed: run `make nats` (Debian package nats-server), or set "
        "nats.embedded=false and nats.url to a running server"
    )


def nats_argv(binary: str, url: str, data_dir: Path) -> list[str]:
    """nats-server with JetStream, its store in ``data_dir``, listening where ``url`` says."""
    host, port = nats_endpoint(url)
    if url.startswith("tls://"):
        raise ValueError("nats.url is tls:// but the embedded nats-server has no certificate: "
                         "run your own server with a tls {} block (nats.embedded=false), "
                         "see docs/operations.md")
    return [binary, "-js", "-sd", str(data_dir), "-p", str(port), "-a", host]


def tcp_accepts(host: str, port: int, timeout: float = 0.2) -> bool:
    """True when something accepts a TCP connection on host:port."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False
