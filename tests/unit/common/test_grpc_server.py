"""serve_grpc: a free port, the servicers registered, malformed requests refused, options
applied, and a bind failure that names the part."""

from __future__ import annotations

import grpc
import pytest

from services.common.config import parse_config
from services.common.grpc_server import serve_grpc
from services.gen import router_pb2, router_pb2_grpc
from services.router.grpc_server import RouterServicer
from services.router.router import Router

_ROUTE = "/tandem.router.Router/Route"


def _servicer() -> RouterServicer:
    return RouterServicer(Router(parse_config({})))  # no workers: Route is UNAVAILABLE


async def test_serves_on_a_free_port_with_malformed_requests_refused() -> None:
    server, port = await serve_grpc("router", "127.0.0.1", 0, _servicer().add_to)
    try:
        assert port > 0
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Route(router_pb2.RouteRequest(request_id="r", token_ids=[1, 2]))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # the servicer answered
            raw = ch.unary_unary(_ROUTE, request_serializer=None, response_deserializer=None)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await raw(b"\xff\xff\xff")
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        await server.stop(0)


async def test_options_reach_the_server() -> None:
    server, port = await serve_grpc("router", "127.0.0.1", 0, _servicer().add_to,
                                    options=[("grpc.max_receive_message_length", 64)])
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Route(router_pb2.RouteRequest(request_id="r", token_ids=[1] * 100))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        await server.stop(0)


async def test_a_bind_failure_is_an_oserror_naming_the_part() -> None:
    with pytest.raises(OSError, match=r"^router: cannot bind gRPC port 256\.0\.0\.1:0"):
        await serve_grpc("router", "256.0.0.1", 0, _servicer().add_to)
