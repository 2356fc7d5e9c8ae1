"""proto/router.proto <-> route.py: Route and Update, the processor -> router hop."""

from __future__ import annotations

from services.api.route import RequestPhase, RouteRequest, RouteResponse
from services.gen import router_pb2

_PHASE_TO_PB = {
    RequestPhase.PREFILLED: router_pb2.RequestUpdate.PREFILLED,
    RequestPhase.FINISHED: router_pb2.RequestUpdate.FINISHED,
}
_PHASE_FROM_PB = {v: k for k, v in _PHASE_TO_PB.items()}


def route_request_to_pb(req: RouteRequest) -> router_pb2.RouteRequest:
    return router_pb2.RouteRequest(request_id=req.request_id, token_ids=req.token_ids,
                                   local_hashes=req.local_hashes or (),
                                   exclude_workers=req.exclude_workers)


def route_request_from_pb(m: router_pb2.RouteRequest) -> RouteRequest:
    """Unchecked: ``Router.route`` checks the ids and hashes, as for an in-process caller."""
    return RouteRequest(request_id=m.request_id, token_ids=m.token_ids,
                        local_hashes=list(m.local_hashes) or None,
                        exclude_workers=tuple(m.exclude_workers))


def route_response_to_pb(r: RouteResponse) -> router_pb2.RouteResponse:
    return router_pb2.RouteResponse(
        worker_id=r.worker_id, overlap_blocks=r.overlap_blocks, request_blocks=r.request_blocks,
        prefix_hit_rate=r.prefix_hit_rate, address=r.address)


def route_response_from_pb(m: router_pb2.RouteResponse) -> RouteResponse:
    return RouteResponse(m.worker_id, m.overlap_blocks, m.request_blocks, m.prefix_hit_rate,
                         m.address)


def update_to_pb(request_id: str, phase: RequestPhase) -> router_pb2.RequestUpdate:
    return router_pb2.RequestUpdate(request_id=request_id, phase=_PHASE_TO_PB[phase])


def phase_from_pb(m: router_pb2.RequestUpdate) -> RequestPhase | None:
    """None for UNSPECIFIED and for a phase this build does not know."""
    return _PHASE_FROM_PB.get(m.phase)
