"""Router bookkeeping from the processor: published on the in-flight subject when a
publisher is given (no call to the router), else applied by the router before ``send``
returns; a failed report is logged and dropped, never raised into the request."""

from __future__ import annotations

from services.api.route import RequestPhase, RouteRequest
from services.api.wire import InflightOp, InflightUpdate
from services.common.discovery import Registration
from services.processor.router_reports import RouterReports
from tests.support.mock_cluster import mock_cluster_cfg
from tests.support.stack import RecordingRouter


def _router() -> RecordingRouter:
    router = RecordingRouter(mock_cluster_cfg())
    router.worker_joined(Registration("decode", "w0", address="127.0.0.1:1"))
    return router


async def test_without_a_publisher_the_router_has_each_report_when_send_returns() -> None:
    router = _router()
    reports = RouterReports(router)
    await router.route(RouteRequest("a", list(range(64))))
    await reports.send("a", RequestPhase.PREFILLED)
    assert router.updates == [("a", RequestPhase.PREFILLED)]
    assert router.load.view("w0").pending_prefill_blocks == 0
    assert router.load.inflight_count("w0") == 1
    await reports.send("a", RequestPhase.FINISHED)
    assert router.updates[-1] == ("a", RequestPhase.FINISHED)
    assert router.load.inflight_count("w0") == 0
    router.fail_updates_for.add("gone")
    await reports.send("gone", RequestPhase.FINISHED)  # logged, not raised
    await reports.send_now("gone", RequestPhase.FINISHED)
    assert ("gone", RequestPhase.FINISHED) not in router.updates


async def test_with_a_publisher_reports_are_published_in_order_not_sent_to_the_router() -> None:
    router = _router()
    published: list[InflightUpdate] = []

    async def publish(u: InflightUpdate) -> None:
        published.append(u)

    reports = RouterReports(router, publish, sender="processor-3")
    await reports.send("a", RequestPhase.PREFILLED)
    await reports.send("a", RequestPhase.FINISHED)
    assert published == [InflightUpdate("processor-3", InflightOp.PREFILLED, "a"),
                         InflightUpdate("processor-3", InflightOp.FREE, "a")]
    assert router.updates == []
    # Migration's FINISHED must be applied before the id is routed again: it goes to the router.
    await router.route(RouteRequest("m", list(range(32))))
    await reports.send_now("m", RequestPhase.FINISHED)
    assert router.updates == [("m", RequestPhase.FINISHED)] and router.load.inflight_count("w0") == 0

    async def broken(u: InflightUpdate) -> None:
        raise ConnectionError("nats down")

    await RouterReports(router, broken).send("x", RequestPhase.FINISHED)  # logged, not raised
