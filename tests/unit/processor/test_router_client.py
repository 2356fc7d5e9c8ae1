"""RouterClient: round-robin over the routers in discovery, one retry on another replica
after an Unavailable, a failed replica passed over for a while, one that left not picked."""

from __future__ import annotations

import grpc
import pytest

from services.api.route import RequestPhase, RouteRequest, RouteResponse
from services.api.route_codec import route_response_to_pb
from services.common.address_book import AddressBook
from services.common.discovery import Registration
from services.common.errors import InvalidRequest, Unavailable
from services.gen import router_pb2
from services.processor.router_client import RouterClient

OK = route_response_to_pb(RouteResponse("decode-0", 1, 2, 0.5, "127.0.0.1:9300"))


def rpc_error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), "boom")


class FakeStub:
    """A router replica: answers, or fails every call with ``fail``."""

    def __init__(self, addr: str, calls: list[str], fail: grpc.StatusCode | None) -> None:
        self.addr, self.calls, self.fail = addr, calls, fail

    async def Route(self, msg, timeout, metadata):  # noqa: N802
        self.calls.append(self.addr)
        if self.fail is not None:
            raise rpc_error(self.fail)
        return OK

    async def Update(self, msg, timeout, metadata):  # noqa: N802
        self.calls.append(self.addr)
        if self.fail is not None:
            raise rpc_error(self.fail)
        return router_pb2.UpdateAck()


class FakePool:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.failing: dict[str, grpc.StatusCode] = {}

    def stub(self, addr: str, cls) -> FakeStub:
        return FakeStub(addr, self.calls, self.failing.get(addr))


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def setup(n: int) -> tuple[AddressBook, FakePool, Clock, RouterClient]:
    book = AddressBook("router")
    for i in range(n):
        book.joined(Registration("router", f"router-{i}", f"10.0.0.{i}:9200"))
    pool, clock = FakePool(), Clock()
    return book, pool, clock, RouterClient(book, pool, cooldown_s=2.0, clock=clock)  # type: ignore[arg-type]


def req(i: int = 0) -> RouteRequest:
    return RouteRequest(f"r{i}", list(range(32)))


async def test_routes_spread_round_robin_over_the_replicas() -> None:
    _, pool, _, client = setup(3)
    for i in range(6):
        assert (await client.route(req(i))).worker_id == "decode-0"
    assert sorted(pool.calls) == sorted(["10.0.0.0:9200", "10.0.0.1:9200", "10.0.0.2:9200"] * 2)


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED])
async def test_an_unavailable_replica_is_retried_once_on_another(code: grpc.StatusCode) -> None:
    _, pool, clock, client = setup(2)
    pool.failing["10.0.0.0:9200"] = code
    for i in range(4):
        assert (await client.route(req(i))).worker_id == "decode-0"
    # the down replica took one call, then was passed over while cooling down
    assert pool.calls.count("10.0.0.0:9200") == 1
    assert pool.calls.count("10.0.0.1:9200") == 4
    clock.t = 2.5  # cooled down: tried again (and retried elsewhere again)
    pool.calls.clear()
    for i in range(2):
        await client.route(req(i))
    assert pool.calls.count("10.0.0.0:9200") == 1


async def test_updates_fail_over_too() -> None:
    _, pool, _, client = setup(2)
    pool.failing["10.0.0.1:9200"] = grpc.StatusCode.UNAVAILABLE
    for i in range(3):
        await client.update(f"r{i}", RequestPhase.FINISHED)
    assert pool.calls.count("10.0.0.0:9200") == 3


async def test_a_second_failure_reaches_the_caller() -> None:
    _, pool, _, client = setup(3)
    for a in ("10.0.0.0:9200", "10.0.0.1:9200", "10.0.0.2:9200"):
        pool.failing[a] = grpc.StatusCode.UNAVAILABLE
    with pytest.raises(Unavailable, match="router 10.0.0"):
        await client.route(req())
    assert len(pool.calls) == 2  # retried once, not on every replica


async def test_one_replica_is_not_retried() -> None:
    _, pool, _, client = setup(1)
    pool.failing["10.0.0.0:9200"] = grpc.StatusCode.UNAVAILABLE
    with pytest.raises(Unavailable):
        await client.route(req())
    assert len(pool.calls) == 1
    pool.failing.clear()  # all replicas cooling down: the only one is tried anyway
    assert (await client.route(req())).worker_id == "decode-0"


async def test_other_errors_are_not_retried() -> None:
    _, pool, _, client = setup(2)
    pool.failing = {a: grpc.StatusCode.INVALID_ARGUMENT for a in ("10.0.0.0:9200", "10.0.0.1:9200")}
    with pytest.raises(InvalidRequest):
        await client.route(req())
    assert len(pool.calls) == 1


async def test_a_replica_that_left_discovery_is_not_picked() -> None:
    book, pool, _, client = setup(2)
    book.left("router-0")
    for i in range(4):
        await client.route(req(i))
    assert set(pool.calls) == {"10.0.0.1:9200"}
    book.left("router-1")
    with pytest.raises(Unavailable, match="no router is registered"):
        await client.route(req())
