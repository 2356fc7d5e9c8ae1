"""Checks `tandem up` makes before it starts anything, each failing with a message that
says what is wrong and which config key fixes it."""

from __future__ import annotations

import socket

from services.common.config import ClusterConfig
from services.launcher.nats import nats_endpoint, tcp_accepts
from services.launcher.plan import PortUse, ProcessSpec, port_owners


class PreflightError(RuntimeError):
    """The cluster cannot start as configured; nothing has been started."""


def port_is_free(port: int) -> bool:
    """True when nothing on this machine listens on ``port`` (on any address)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # Same option the servers set: a port in TIME_WAIT from a previous run is free.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def check_ports_free(specs: list[ProcessSpec], launcher: tuple[PortUse, ...] = ()) -> None:
    """PreflightError listing every planned port (``launcher``: the launcher's own) that
    something already holds."""
    busy = [(name, p) for name, p in port_owners(specs, launcher) if not port_is_free(p.port)]
    if busy:
        lines = [f"  port {p.port} ({name} {p.label}, set by {p.key})" for name, p in busy]
        raise PreflightError(
            "ports already in use, nothing was started:\n" + "\n".join(lines)
            + "\nstop what holds them (an earlier `tandem up`?) or move them with --set KEY=PORT"
        )


def check_external_nats(cfg: ClusterConfig) -> None:
    """With ``nats.embedded: false`` the named server must already be reachable."""
    host, port = nats_endpoint(cfg.nats.url)
    if not tcp_accepts(host, port, timeout=1.0):
        raise PreflightError(
            f"nats.embedded is false but nothing accepts connections at nats.url={cfg.nats.url}; "
            "start that server or set nats.embedded=true"
        )


def check_model(cfg: ClusterConfig) -> None:
    """Workers running the torch runner need the model on disk (``tandem model pull``)."""
    if cfg.engine.runner != "torch" or (cfg.decode.replicas == 0 and cfg.prefill.replicas == 0):
        return
    from services.model.store import ModelNotFoundError, resolve_model_path

    try:
        resolve_model_path(cfg.model.path)
    except ModelNotFoundError as e:
        raise PreflightError(f"model.path: {e}") from None
