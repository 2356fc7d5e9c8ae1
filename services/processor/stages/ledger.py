"""Stage 6: what a routed request leaves behind whatever its end (finish, stop string,
error, cancellation): its outcome in the metrics and its FINISHED report to the router,
sent once, so no load leaks."""

from __future__ import annotations

from services.api.processor import Delta
from services.api.route import RequestPhase
from services.common.errors import ServingError
from services.processor.metrics import ProcessorMetrics
from services.processor.router_reports import RouterReports


class Ledger:
    """Made once the request is routed: counts its prompt tokens and keeps it in flight
    until ``close``. An end the stream never reports (the client went away) counts as
    "cancelled"."""

    def __init__(self, metrics: ProcessorMetrics, reports: RouterReports, request_id: str,
                 prompt_tokens: int) -> None:
        self._metrics = metrics
        self._reports = reports
        self._request_id = request_id
        self._outcome = "cancelled"
        self._released = False
        metrics.prompt_tokens.inc(prompt_tokens)
        metrics.inflight.inc()

    def note(self, d: Delta) -> bool:
        """Before ``d`` goes out: True for the request's last delta (the one with the usage),
        when its load is to be ``release``d. Not a coroutine: it runs for every delta."""
        if d.finish_reason is not None:
            self._outcome = d.finish_reason.value
        return d.usage is not None

    async def release(self) -> None:
        self._released = True
        await self._reports.send(self._request_id, RequestPhase.FINISHED)

    def failed(self, e: Exception) -> None:
        self._outcome = e.kind if isinstance(e, ServingError) else "error"

    async def close(self) -> None:
        self._metrics.inflight.dec()
        self._metrics.requests.labels(self._outcome).inc()
        if not self._released:
            await self._reports.send(self._request_id, RequestPhase.FINISHED)
