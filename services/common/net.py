"""Addresses a service publishes in discovery."""

from __future__ import annotations

import socket


def advertised_host(bind_host: str) -> str:
    """The host peers should dial: the bind host itself, or this machine's hostname when
    bound to every interface (in compose and Kubernetes the hostname resolves for peers)."""
    return socket.gethostname() if bind_host in ("0.0.0.0", "::", "") else bind_host
