"""gRPC adapter for the Router part, and ``serve`` (what `tandem router -c FILE` runs)."""

from __future__ import annotations

import logging

import grpc
from prometheus_client import start_http_server

from services.common.config import ClusterConfig
from services.common.discovery import Registration
from services.common.errors import InvalidRequest, ServingError, abort
from services.common.grpc_server import serve_grpc
from services.common.net import advertised_host
from services.common.service import stop_on_signals
from services.gen import router_pb2, router_pb2_grpc
from services.router.router import Router, tune_gc_for_index
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

