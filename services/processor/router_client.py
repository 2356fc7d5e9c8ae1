"""The router over gRPC with the in-process ``Router``'s methods (``route``, ``update``) and
its typed errors, so the processor takes either."""

from __future__ import annotations

import grpc

from services.api.route import RequestPhase, RouteRequest, RouteResponse
from services.api.route_codec import route_request_to_pb, route_response_from_pb, update_to_pb
from services.common.address_book import AddressBook, ChannelPool
from services.common.errors import ServingError, Unavailable, from_rpc_error
from services.common.grpc_auth import call_metadata
from services.gen import router_pb2_grpc


class RouterClient:
    """Calls a router replica picked from ``book`` (round-robin over live routers)."""

    def __init__(self, book: AddressBook, pool: ChannelPool, timeout_s: float = 5.0) -> None:
        self._book = book
        self._pool = pool
        self._timeout = timeout_s

    def _stub(self) -> tuple[str, router_pb2_grpc.RouterStub]:
        addr = self._book.pick()
        if addr is None:
            raise Unavailable("no router is registered in discovery")
        return addr, self._pool.stub(addr, router_pb2_grpc.RouterStub)

    async def route(self, req: RouteRequest) -> RouteResponse:
        msg = route_request_to_pb(req)
        addr, stub = self._stub()
        try:
            r = await stub.Route(msg, timeout=self._timeout, metadata=call_metadata())
        except grpc.aio.AioRpcError as e:
            raise _translate(addr, e) from None
        return route_response_from_pb(r)

    async def update(self, request_id: str, phase: RequestPhase) -> None:
        msg = update_to_pb(request_id, phase)
        addr, stub = self._stub()
        try:
            await stub.Update(msg, timeout=self._timeout, metadata=call_metadata())
        except grpc.aio.AioRpcError as e:
            raise _translate(addr, e) from None


def _translate(addr: str, e: grpc.aio.AioRpcError) -> ServingError:
    if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:  # a stuck router: retry later, like down
        return Unavailable(f"router {addr}: {e.details() or e.code().name}")
    return from_rpc_error(e, f"router {addr}", name_peer=True)
