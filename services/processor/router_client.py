"""The router over gRPC with the in-process ``Router``'s methods (``route``, ``update``) and
its typed errors, so the processor takes either."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

from services.api.route import RequestPhase, RouteRequest, RouteResponse
from services.api.route_codec import route_request_to_pb, route_response_from_pb, update_to_pb
from services.common.address_book import AddressBook, ChannelPool
from services.common.errors import ServingError, Unavailable, from_rpc_error
from services.common.grpc_auth import call_metadata
from services.gen import router_pb2_grpc

T = TypeVar("T")
Call = Callable[[router_pb2_grpc.RouterStub], Awaitable[T]]

# A replica that failed a call is passed over this long (while another is live): a router
# that was killed stays in discovery until its registration's TTL runs out, and one that
# is stuck would cost every call sent to it the whole deadline.
DEFAULT_COOLDOWN_S = 2.0


class RouterClient:
    """Calls a router replica picked from ``book`` (round-robin over live routers).

    Failover: a call that fails Unavailable (the replica is down, its deadline passed, or
    it knows no worker) is retried once on another replica; only the second failure
    reaches the caller. The failed replica is then passed over for ``cooldown_s`` unless
    every replica is. Every replica holds the same index and in-flight view, so the retry
    routes as the first would have. (A route whose deadline passed may still have been
    applied by the first replica: its in-flight add then names that replica's worker until
    the request's free; the load view is off by one request, not leaked.)"""

    def __init__(self, book: AddressBook, pool: ChannelPool, timeout_s: float = 5.0,
                 cooldown_s: float = DEFAULT_COOLDOWN_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._book = book
        self._pool = pool
        self._timeout = timeout_s
        self._cooldown = cooldown_s
        self._clock = clock
        self._down: dict[str, float] = {}  # address -> until when it is passed over

    async def route(self, req: RouteRequest) -> RouteResponse:
        msg = route_request_to_pb(req)
        r = await self._call(lambda stub: stub.Route(msg, timeout=self._timeout,
                                                     metadata=call_metadata()))
        return route_response_from_pb(r)

    async def update(self, request_id: str, phase: RequestPhase) -> None:
        msg = update_to_pb(request_id, phase)
        await self._call(lambda stub: stub.Update(msg, timeout=self._timeout,
                                                  metadata=call_metadata()))

    async def _call(self, call: Call[T]) -> T:
        addr = self._pick(None)
        if addr is None:
            raise Unavailable("no router is registered in discovery")
        try:
            return await self._try(addr, call)
        except Unavailable as first:
            retry = self._pick(addr)
            if retry is None:
                raise first from None
        return await self._try(retry, call)

    async def _try(self, addr: str, call: Call[T]) -> T:
        try:
            return await call(self._pool.stub(addr, router_pb2_grpc.RouterStub))
        except grpc.aio.AioRpcError as e:
            err = _translate(addr, e)
        if isinstance(err, Unavailable):
            self._down[addr] = self._clock() + self._cooldown
        raise err from None

    def _pick(self, failed: str | None) -> str | None:
        """The next replica, passing over ``failed`` always and those in cooldown while
        another is left."""
        book = self._book
        if not self._down:
            return book.pick((failed,) if failed is not None else ())
        now = self._clock()
        for a in [a for a, until in self._down.items() if until <= now]:
            del self._down[a]
        skip = set(self._down)
        if failed is not None:
            skip.add(failed)
        addr = book.pick(skip)
        if addr is None:  # every other replica is cooling down: try one anyway
            addr = book.pick((failed,) if failed is not None else ())
        return addr


def _translate(addr: str, e: grpc.aio.AioRpcError) -> ServingError:
    if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:  # a stuck router: retry later, like down
        return Unavailable(f"router {addr}: {e.details() or e.code().name}")
    return from_rpc_error(e, f"router {addr}", name_peer=True)
