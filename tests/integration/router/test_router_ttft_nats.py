"""The ttft policy against a real nats-server: a processor's published first-token report
reaches the replica that routed the request, which checks its prediction against it."""

from __future__ import annotations

from services.api.route import RequestPhase, RouteRequest
from services.common.config import parse_config
from services.common.discovery import Discovery, Registration
from services.common.nats_client import connect
from services.processor.router_reports import RouterReports, inflight_publisher
from services.router.router import Router


def _cfg(url: str, ns: str):
    return parse_config({
        "namespace": ns, "nats": {"url": url},
        "engine": {"runner": "mock", "block_size": 4, "max_num_batched_tokens": 64},
        "discovery": {"ttl_s": 1.0, "heartbeat_s": 0.2},
        "router": {"mode": "ttft", "ttft_bias_alpha": 0.05},
    })


def _errors(r: Router) -> float:
    return r.metrics.registry.get_sample_value(
        "tandem_router_ttft_prediction_error_seconds_count") or 0.0


async def test_a_published_first_token_corrects_the_routing_replica(nats_url, wait_for) -> None:
    ns = "ttft1"
    cfg = _cfg(nats_url, ns)
    nc = await connect(cfg.nats, "test")
    disc = await Discovery.open(nc, ns, cfg.discovery)
    leases = [await disc.register(Registration("decode", w, address=f"{w}:1")) for w in ("a", "b")]
    try:
        async with Router(cfg) as r1, Router(cfg) as r2:
            await wait_for(lambda: len(r1.workers) == len(r2.workers) == 2, what="discovery")
            reports = RouterReports(r1, inflight_publisher(nc, ns), sender="processor-0")
            resp = await r1.route(RouteRequest("q", list(range(40))))
            await wait_for(lambda: r2.load.inflight_count(resp.worker_id) == 1, what="inflight")
            await reports.send("q", RequestPhase.PREFILLED)
            await wait_for(lambda: _errors(r1) == 1, what="the prediction checked")
            assert r1.ttft is not None and r1.ttft.cluster_bias != 0
            # the other replica routed nothing: it has no prediction to check
            assert _errors(r2) == 0 and r2.ttft is not None and r2.ttft.cluster_bias == 0
            await reports.send("q", RequestPhase.FINISHED)
            await wait_for(lambda: r1.load.inflight_count() == r2.load.inflight_count() == 0,
                           what="finished")
    finally:
        for lease in leases:
            await lease.close()
        await nc.close()
