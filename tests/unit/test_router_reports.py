"""Router bookkeeping sent in the background: per-request order holds even when an earlier
report is slower, failures are dropped, and settled() waits for everything."""

from __future__ import annotations

import asyncio

from services.common.discovery import Registration
from services.processor.router_reports import RouterReports
from services.router.router import Router
from services.router.types import RequestPhase, RouteRequest
from tests.support.stack import mock_cluster_cfg


class RecordingRouter(Router):
    """The real in-process router; PREFILLED reports take longer to arrive than FINISHED."""

    def __init__(self) -> None:
        super().__init__(mock_cluster_cfg())
        self.seen: list[tuple[str, RequestPhase]] = []
        self.fail_for: set[str] = set()

    async def update(self, request_id: str, phase: RequestPhase) -> None:
        if phase is RequestPhase.PREFILLED:
            await asyncio.sleep(0.05)
        if request_id in self.fail_for:
            raise RuntimeError("router unreachable")
        self.seen.append((request_id, phase))
        await super().update(request_id, phase)


async def test_reports_keep_their_order_per_request_and_do_not_block() -> None:
    router = RecordingRouter()
    router.worker_joined(Registration("decode", "w0", address="127.0.0.1:1"))
    reports = RouterReports(router)
    for rid in ("a", "b"):
        await router.route(RouteRequest(rid, list(range(64))))
    assert router.load.inflight_count("w0") == 2
    await reports.send("a", RequestPhase.PREFILLED)
    await reports.send("a", RequestPhase.FINISHED)
    await reports.send("b", RequestPhase.FINISHED)
    assert router.seen == [] and reports.pending == 2  # nothing awaited yet
    await reports.settled()
    # b's FINISHED needed no wait; a's FINISHED waited for a's slower PREFILLED.
    assert router.seen == [("b", RequestPhase.FINISHED), ("a", RequestPhase.PREFILLED),
                           ("a", RequestPhase.FINISHED)]
    assert router.load.inflight_count("w0") == 0 and reports.pending == 0


async def test_send_now_waits_for_earlier_reports_and_failures_are_dropped() -> None:
    router = RecordingRouter()
    router.worker_joined(Registration("decode", "w0", address="127.0.0.1:1"))
    reports = RouterReports(router)
    await router.route(RouteRequest("m", list(range(32))))
    await reports.send("m", RequestPhase.PREFILLED)
    await reports.send_now("m", RequestPhase.FINISHED)
    assert router.seen == [("m", RequestPhase.PREFILLED), ("m", RequestPhase.FINISHED)]
    assert router.load.inflight_count("w0") == 0
    router.fail_for.add("gone")
    await reports.send("gone", RequestPhase.FINISHED)  # logged, not raised
    await reports.settled()
    assert reports.pending == 0 and ("gone", RequestPhase.FINISHED) not in router.seen
