"""gRPC adapter for the Router part (served by services/router/serve.py)."""

from __future__ import annotations

import logging

import grpc

from services.api.route_codec import phase_from_pb, route_request_from_pb, route_response_to_pb
from services.common.errors import InvalidRequest, ServingError, abort
from services.gen import router_pb2, router_pb2_grpc
from services.router.router import Router

log = logging.getLogger(__name__)

class RouterServicer(router_pb2_grpc.RouterServicer):
    """Translates messages and errors; all logic lives in ``Router``."""

    def __init__(self, router: Router) -> None:
        self._router = router

    def add_to(self, server: grpc.aio.Server) -> None:
        """Register on ``server``: the ``register`` callback of ``serve_grpc``."""
        router_pb2_grpc.add_RouterServicer_to_server(self, server)

    async def Route(self, request: router_pb2.RouteRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        try:
            r = await self._router.route(route_request_from_pb(request))
        except ServingError as e:
            await abort(context, e)
        return route_response_to_pb(r)

    async def Update(self, request: router_pb2.RequestUpdate, context: grpc.aio.ServicerContext):  # noqa: N802
        phase = phase_from_pb(request)
        if phase is None:
            await abort(context, InvalidRequest("RequestUpdate.phase is unspecified"))
        try:
            await self._router.update(request.request_id, phase)
        except ServingError as e:
            await abort(context, e)
        return router_pb2.UpdateAck()
