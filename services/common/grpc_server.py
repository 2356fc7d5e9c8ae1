"""``serve_grpc``: how every tandem part opens its gRPC port.

One place, so that every server gets the cluster-token check (grpc_auth.py), the
RejectMalformed interceptor (grpc_guard.py) and the same bind error.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import grpc

from services.common.env import cluster_token
from services.common.grpc_auth import RequireToken
from services.common.grpc_guard import RejectMalformed


async def serve_grpc(
    part: str,
    host: str,
    port: int,
    register: Callable[[grpc.aio.Server], None],
    *,
    options: Sequence[tuple[str, Any]] = (),
) -> tuple[grpc.aio.Server, int]:
    """Start a server with ``register(server)``'s servicers on host:port (0 = a free port);
    returns the server and the bound port. OSError naming ``part`` when the bind fails."""
    token = cluster_token()
    # NOTE: the token check first, so an unauthenticated call's bytes are never parsed.
    interceptors: list[grpc.aio.ServerInterceptor] = [RequireToken(token)] if token else []
    interceptors.append(RejectMalformed())
    server = grpc.aio.server(options=list(options), interceptors=interceptors)
    register(server)
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError as e:  # grpcio's "Failed to bind", typed for callers that catch OSError
        raise OSError(f"{part}: cannot bind gRPC port {host}:{port}: {e}") from e
    await server.start()
    return server, bound
