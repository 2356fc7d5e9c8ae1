"""gRPC adapter for the Router part, and ``serve`` (what `tandem router -c FILE` runs)."""

from __future__ import annotations

import logging

import grpc
from prometheus_client import start_http_server

from services.api.route_codec import phase_from_pb, route_request_from_pb, route_response_to_pb
from services.common.config import ClusterConfig
from services.common.discovery import Registration
from services.common.errors import InvalidRequest, ServingError, abort
from services.common.grpc_server import serve_grpc
from services.common.net import advertised_host
from services.common.service import stop_on_signals
from services.gen import router_pb2, router_pb2_grpc
from services.router.router import Router, tune_gc_for_index

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


async def serve(cfg: ClusterConfig, replica: int = 0, host: str | None = None) -> None:
    """Run one router replica until SIGINT/SIGTERM: gRPC on ``router.port + replica``,
    metrics on ``router.metrics_port + replica``, registered in discovery as role ``router``."""
    host = cfg.bind_host if host is None else host
    tune_gc_for_index()
    router = Router(cfg, replica=replica)
    await router.start()
    # before the port opens: a part that looks ready must stop cleanly (see stop_on_signals)
    stop = stop_on_signals()
    server, port = await serve_grpc("router", host, cfg.router.port + replica,
                                    RouterServicer(router).add_to)
    metrics_port = cfg.router.metrics_port + replica
    start_http_server(metrics_port, registry=router.metrics.registry, addr=host)
    assert router.discovery is not None
    lease = await router.discovery.register(
        Registration("router", f"router-{replica}", address=f"{advertised_host(host)}:{port}",
                     metrics_address=f"{advertised_host(host)}:{metrics_port}")
    )
    log.info("router replica %d serving gRPC on %d, metrics on %d", replica, port, metrics_port)
    try:
        await stop.wait()
    finally:
        await lease.close()
        await server.stop(grace=2)
        await router.close()

