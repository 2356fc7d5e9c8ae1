"""A request's moves from decode workers that failed or drained to others
(docs/reliability.md).

The old worker's load is released (an awaited FINISHED) before the same request id is
routed again, excluding every worker that failed or drained it; failures up to ``limit``
times (a drain is no failure: a draining worker leaves discovery, so it ends)."""

from __future__ import annotations

import logging

from services.api.route import RequestPhase, RouteResponse
from services.common.errors import Overloaded, Unavailable
from services.processor.metrics import ProcessorMetrics
from services.processor.router_reports import RouterReports
from services.processor.stages.prompt import Prompt
from services.processor.stages.route import RouteStage

log = logging.getLogger(__name__)


class Migration:
    """One per request, made as its stream starts."""

    def __init__(self, routes: RouteStage, reports: RouterReports, metrics: ProcessorMetrics,
                 limit: int, request_id: str, prompt: Prompt) -> None:
        self._routes = routes
        self._reports = reports
        self._metrics = metrics
        self._limit = limit
        self._request_id = request_id
        self._prompt = prompt
        self._failed: list[str] = []  # worker ids that failed this request
        self._drained: list[str] = []  # worker ids that moved it off as they drained
        self._full = 0  # of the failed, refused because their queue was full

    @property
    def moved(self) -> bool:
        return bool(self._failed or self._drained)

    async def move(self, route: RouteResponse, produced: list[int], failure: str,
                   overloaded: bool = False, drained: bool = False) -> RouteResponse:
        """The next worker for the request ``route``'s worker failed (``overloaded``: it
        refused, its queue full; ``drained``: it is draining and moved the request off)
        after ``produced``. Unavailable when the limit is reached or no other worker is
        left; Overloaded instead when nothing was produced and every worker that failed was
        full (a 429)."""
        self._full += overloaded
        try:
            return await self._next(route, produced, failure, drained)
        except Unavailable as e:
            if not produced and self._failed and self._full == len(self._failed):
                raise Overloaded(e.message, code="overloaded") from None
            raise

    async def _next(self, route: RouteResponse, produced: list[int], failure: str,
                    drained: bool) -> RouteResponse:
        (self._drained if drained else self._failed).append(route.worker_id)
        what = (f"decode worker {route.worker_id} ({route.address}) {failure} after "
                f"{len(produced)} tokens")
        # The old worker no longer carries this request's load (before the same id is
        # routed again).
        await self._reports.send_now(self._request_id, RequestPhase.FINISHED)
        if len(self._failed) > self._limit:
            raise Unavailable(f"{what}; gave up after {self._limit} migrations")
        if not drained:
            log.warning("%s; migrating %s (attempt %d of %d)", what, self._request_id,
                        len(self._failed), self._limit)
        try:
            new = await self._routes.route(self._request_id, self._prompt, produced,
                                           exclude=tuple(self._failed + self._drained))
        except Unavailable as e:
            raise Unavailable(f"{what}; no other decode worker can continue it: {e}") from None
        if not drained:
            self._metrics.migrations.inc()
        return new
