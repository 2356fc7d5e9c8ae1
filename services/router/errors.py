"""The router's typed errors (common/errors.py's table maps them to gRPC and HTTP)."""

from __future__ import annotations

from services.common.errors import InvalidRequest, Unavailable


class InvalidRouteRequest(InvalidRequest, ValueError):
    """The request cannot be routed as given."""


class NoWorkersAvailable(Unavailable, RuntimeError):
    """No decode worker (or no router) is registered in discovery."""
