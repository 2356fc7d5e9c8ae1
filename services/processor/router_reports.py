"""A request's router bookkeeping (PREFILLED at the first token, FINISHED at the end), sent
off the stream's path.

Awaiting the router's gRPC ``Update`` would add a round trip (~0.4 ms) to a request's first
token and another to its last, and cost the router a gRPC call each. So a deployed
processor publishes the update on NATS, on the subject the router replicas already share
their in-flight updates on: every replica applies it, the publish only appends to the
connection's buffer, and one connection's messages arrive in order, so a request's
FINISHED never overtakes its PREFILLED. Without NATS (a processor wired to an in-process
router) each report is a background ``router.update`` that waits for the request's
previous one. Either way a lost report is logged and dropped: the router expires
in-flight entries by TTL.

Migration is the exception (``send_now``): the failed worker's FINISHED must be applied
before the same request id is routed again, so it is an awaited ``router.update``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

from services.common.wire import InflightOp, InflightUpdate
from services.router.types import RequestPhase, RouteRequest, RouteResponse

log = logging.getLogger(__name__)

Publish = Callable[[InflightUpdate], Awaitable[None]]

_OPS = {RequestPhase.PREFILLED: InflightOp.PREFILLED, RequestPhase.FINISHED: InflightOp.FREE}


class RouterLike(Protocol):
    async def route(self, req: RouteRequest) -> RouteResponse: ...
    async def update(self, request_id: str, phase: RequestPhase) -> None: ...


class RouterReports:
    """``publish``: puts an update on the routers' in-flight subject (None: call the router);
    ``sender``: the replica id the updates carry (never a router's own instance id)."""

    def __init__(self, router: RouterLike, publish: Publish | None = None,
                 sender: str = "processor") -> None:
        self._router = router
        self._publish = publish
        self._sender = sender
        self._last: dict[str, asyncio.Task[None]] = {}  # request id -> its latest report

    async def send(self, request_id: str, phase: RequestPhase) -> None:
        """Report without waiting for the router, after this request's earlier reports."""
        if self._publish is not None:
            try:
                await self._publish(InflightUpdate(self._sender, _OPS[phase], request_id))
            except Exception as e:
                log.warning("router update %s for %s not published: %s", phase.value, request_id, e)
            return
        prev = self._last.get(request_id)
        task = asyncio.get_running_loop().create_task(self._update(request_id, phase, prev))
        self._last[request_id] = task
        task.add_done_callback(lambda t: self._forget(request_id, t))

    async def send_now(self, request_id: str, phase: RequestPhase) -> None:
        """Report and wait until the router has applied it."""
        await self._update(request_id, phase, self._last.pop(request_id, None))

    async def settled(self) -> None:
        """Wait for the background ``router.update`` calls made so far (published reports
        are the connection's to deliver)."""
        while self._last:
            await asyncio.wait(list(self._last.values()))

    @property
    def pending(self) -> int:
        return len(self._last)

    async def _update(self, request_id: str, phase: RequestPhase, after: asyncio.Task[None] | None) -> None:
        if after is not None and not after.done():
            await asyncio.wait([after])
        try:
            await self._router.update(request_id, phase)
        except Exception as e:  # bookkeeping only: the router expires it by TTL anyway
            log.warning("router update %s for %s failed: %s", phase.value, request_id, e)

    def _forget(self, request_id: str, task: asyncio.Task[None]) -> None:
        if self._last.get(request_id) is task:
            del self._last[request_id]
