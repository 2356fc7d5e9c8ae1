"""gRPC adapter for the Router part (served by services/router/serve.py)."""

from __future__ import annotations

import logging

import grpc

from services.common.errors import InvalidRequest, ServingError, abort
from services.gen import router_pb2, router_pb2_grpc
from services.router.router import Router
from services.router.types import RequestPhase, RouteRequest

log = logging.getLogger(__name__)

_PHASES = {
    router_pb2.RequestUpdate.PREFILLED: RequestPhase.PREFILLED,
    router_pb2.RequestUpdate.FINISHED: RequestPhase.FINISHED,
}


class RouterServicer(router_pb2_grpc.RouterServicer):
    """Translates messages and errors; all logic lives in ``Router``."""

    def __init__(self, router: Router) -> None:
        self._router = router

    def add_to(self, server: grpc.aio.Server) -> None:
        """Register on ``server``: the ``register`` callback of ``serve_grpc``."""
        router_pb2_grpc.add_RouterServicer_to_server(self, server)

    async def Route(self, request: router_pb2.RouteRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        req = RouteRequest(
            request_id=request.request_id,
            token_ids=request.token_ids,
            local_hashes=list(request.local_hashes) or None,
            exclude_workers=tuple(request.exclude_workers),
        )
        try:
            r = await self._router.route(req)
        except ServingError as e:
            await abort(context, e)
        return router_pb2.RouteResponse(
            worker_id=r.worker_id, overlap_blocks=r.overlap_blocks, request_blocks=r.request_blocks,
            prefix_hit_rate=r.prefix_hit_rate, address=r.address,
        )

    async def Update(self, request: router_pb2.RequestUpdate, context: grpc.aio.ServicerContext):  # noqa: N802
        phase = _PHASES.get(request.phase)
        if phase is None:
            await abort(context, InvalidRequest("RequestUpdate.phase is unspecified"))
        try:
            await self._router.update(request.request_id, phase)
        except ServingError as e:
            await abort(context, e)
        return router_pb2.UpdateAck()
