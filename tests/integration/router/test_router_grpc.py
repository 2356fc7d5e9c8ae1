"""The Router over real gRPC: status codes for bad input and no workers, and a routed call."""

from __future__ import annotations

import grpc
import pytest

from services.common.config import parse_config
from services.common.discovery import Discovery, Registration
from services.common.grpc_server import serve_grpc
from services.common.hashing import local_block_hashes
from services.common.nats_client import connect
from services.gen import router_pb2, router_pb2_grpc
from services.router.grpc_server import RouterServicer
from services.router.router import Router


async def test_route_over_grpc(nats_url: str, wait_for) -> None:
    cfg = parse_config({
        "namespace": "g1", "nats": {"url": nats_url},
        "discovery": {"ttl_s": 2.0, "heartbeat_s": 0.5},
    })
    async with Router(cfg) as router:
        server, port = await serve_grpc("router", "127.0.0.1", 0, RouterServicer(router).add_to)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = router_pb2_grpc.RouterStub(ch)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Route(router_pb2.RouteRequest(request_id="r0"))
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "token_ids" in (err.value.details() or "")
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Route(router_pb2.RouteRequest(request_id="r0", token_ids=[1] * 40))
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE

                nc = await connect(cfg.nats, "worker")
                disc = await Discovery.open(nc, "g1", cfg.discovery)
                lease = await disc.register(Registration("decode", "w0", address="10.0.0.1:9300"))
                await wait_for(lambda: "w0" in router.workers, what="discovery")
                tokens = list(range(40))
                resp = await stub.Route(router_pb2.RouteRequest(request_id="r1", token_ids=tokens))
                assert (resp.worker_id, resp.address, resp.request_blocks) == ("w0", "10.0.0.1:9300", 2)
                # precomputed hashes are accepted too
                resp2 = await stub.Route(router_pb2.RouteRequest(
                    request_id="r2", local_hashes=local_block_hashes(tokens, 16)))
                assert resp2.request_blocks == 2
                # hashes that do not match the token ids (another block size) are refused
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Route(router_pb2.RouteRequest(
                        request_id="r3", token_ids=tokens, local_hashes=local_block_hashes(tokens, 8)))
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "expected one per full block" in (err.value.details() or "")
                assert router.load.inflight_count("w0") == 2
                await stub.Update(router_pb2.RequestUpdate(request_id="r1", phase=router_pb2.RequestUpdate.FINISHED))
                assert router.load.inflight_count("w0") == 1
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Update(router_pb2.RequestUpdate(request_id="r2"))
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                decisions = router.metrics.registry.get_sample_value(
                    "tandem_router_decisions_total", {"worker": "w0"})
                assert decisions == 2
                await lease.close()
                await nc.close()
        finally:
            await server.stop(grace=0)
