"""A request's router bookkeeping (PREFILLED at the first token, FINISHED at the end), sent
off the stream's path.

Awaiting the router's gRPC ``Update`` would add a round trip (~0.4 ms) to a request's first
token and another to its last, and cost the router a gRPC call each. So a deployed
processor publishes the update on NATS, on the subject the router replicas already share
their in-flight updates on (``inflight_publisher``): every replica applies it, the publish
only appends to the connection's buffer, and one connection's messages arrive in order, so
a request's FINISHED never overtakes its PREFILLED. Without a publisher (a processor wired
to an in-process router, as the unit tests do) a report is an awaited ``router.update``.
Either way a lost report is logged and dropped: the router expires in-flight entries by TTL.

Migration is the exception (``send_now``): the failed worker's FINISHED must be applied
before the same request id is routed again, so it is always an awaited ``router.update``.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

from services.api.route import RequestPhase, RouteRequest, RouteResponse
from services.api.wire import InflightOp, InflightUpdate, encode_inflight
from services.common.nats_client import NatsClient, Subjects

log = logging.getLogger(__name__)

Publish = Callable[[InflightUpdate], Awaitable[None]]

_OPS = {RequestPhase.PREFILLED: InflightOp.PREFILLED, RequestPhase.FINISHED: InflightOp.FREE}


class RouterLike(Protocol):
    async def route(self, req: RouteRequest) -> RouteResponse: ...
    async def update(self, request_id: str, phase: RequestPhase) -> None: ...


def inflight_publisher(nc: NatsClient, namespace: str) -> Publish:
    """Publishes an update on ``namespace``'s router in-flight subject."""
    subject = Subjects(namespace).router_inflight

    async def publish(u: InflightUpdate) -> None:
        await nc.publish(subject, encode_inflight(u))

    return publish


class RouterReports:
    """``publish``: puts an update on the routers' in-flight subject (None: call the router);
    ``sender``: the replica id the updates carry (never a router's own instance id)."""

    def __init__(self, router: RouterLike, publish: Publish | None = None,
                 sender: str = "processor") -> None:
        self._router = router
        self._publish = publish
        self._sender = sender

    async def send(self, request_id: str, phase: RequestPhase) -> None:
        """Report without a round trip to the router where a publisher is given."""
        if self._publish is None:
            await self.send_now(request_id, phase)
            return
        try:
            await self._publish(InflightUpdate(self._sender, _OPS[phase], request_id))
        except Exception as e:
            log.warning("router update %s for %s not published: %s", phase.value, request_id, e)

    async def send_now(self, request_id: str, phase: RequestPhase) -> None:
        """Report and wait until the router has applied it."""
        try:
            await self._router.update(request_id, phase)
        except Exception as e:  # bookkeeping only: the router expires it by TTL anyway
            log.warning("router update %s for %s failed: %s", phase.value, request_id, e)
