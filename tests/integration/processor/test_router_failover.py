"""The processor's RouterClient over two real router replicas (gRPC servers registered in
discovery on a real nats-server): routes spread over both, keep succeeding when one dies
while discovery still lists it, and go only to the live one once its registration expires."""

from __future__ import annotations

import grpc

from services.api.route import RouteRequest
from services.common.address_book import AddressBook, ChannelPool
from services.common.config import ClusterConfig, parse_config
from services.common.discovery import Discovery, Lease, Registration
from services.common.grpc_server import serve_grpc
from services.common.nats_client import NatsClient, connect
from services.processor.router_client import RouterClient
from services.router.grpc_server import RouterServicer
from services.router.router import Router

NS = "failover"


def _cfg(url: str) -> ClusterConfig:
    return parse_config({"namespace": NS, "nats": {"url": url},
                         "discovery": {"ttl_s": 1.0, "heartbeat_s": 0.2}})


class Replica:
    """One router replica as `tandem router --replica N` runs it: the Router, its gRPC
    server, its discovery registration."""

    def __init__(self, cfg: ClusterConfig, i: int) -> None:
        self.router = Router(cfg, replica=i)
        self.i = i
        self.server: grpc.aio.Server | None = None
        self.lease: Lease | None = None

    async def start(self, disc: Discovery) -> None:
        await self.router.start()
        self.server, port = await serve_grpc("router", "127.0.0.1", 0, RouterServicer(self.router).add_to)
        self.lease = await disc.register(Registration("router", f"router-{self.i}", f"127.0.0.1:{port}"))

    def decisions(self) -> float:
        reg = self.router.metrics.registry
        return sum(reg.get_sample_value("tandem_router_decisions_total", {"worker": w}) or 0.0
                   for w in ("w0", "w1"))

    async def crash(self) -> None:
        """Gone without deregistering: discovery lists it until its TTL runs out."""
        assert self.server is not None and self.lease is not None
        await self.server.stop(grace=0)
        await self.lease.close(delete=False)
        await self.router.close()

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(grace=0)
        if self.lease is not None:
            await self.lease.close()
        await self.router.close()


async def _routes(client: RouterClient, prefix: str, n: int) -> list[str]:
    return [(await client.route(RouteRequest(f"{prefix}{i}", [i] * 32))).worker_id for i in range(n)]


async def test_routes_survive_a_replica_that_dies(nats_url: str, wait_for) -> None:
    cfg = _cfg(nats_url)
    nc: NatsClient = await connect(cfg.nats, "test")
    disc = await Discovery.open(nc, NS, cfg.discovery)
    workers = [await disc.register(Registration("decode", f"w{i}", f"10.0.0.{i}:9300"))
               for i in range(2)]
    replicas = [Replica(cfg, i) for i in range(2)]
    book, pool = AddressBook("router"), ChannelPool()
    try:
        for r in replicas:
            await r.start(disc)
        book.start(disc)
        client = RouterClient(book, pool, timeout_s=2.0)
        await wait_for(lambda: len(book) == 2 and all(len(r.router.workers) == 2 for r in replicas),
                       what="discovery")

        assert set(await _routes(client, "a", 8)) <= {"w0", "w1"}
        assert [r.decisions() for r in replicas] == [4, 4]  # spread round-robin
        # every replica counts every route: each saw the other's adds
        await wait_for(lambda: all(r.router.load.inflight_count() == 8 for r in replicas),
                       what="shared in-flight")

        await replicas[0].crash()
        assert len(book) == 2  # still registered: calls to it fail and are retried
        assert len(await _routes(client, "b", 8)) == 8
        assert replicas[1].decisions() == 4 + 8

        await wait_for(lambda: len(book) == 1, timeout=5.0, what="registration expired")
        assert len(await _routes(client, "c", 4)) == 4
        assert replicas[1].decisions() == 4 + 8 + 4

        # a replica that comes back is picked again
        replicas[0] = Replica(cfg, 0)
        await replicas[0].start(disc)
        await wait_for(lambda: len(book) == 2 and len(replicas[0].router.workers) == 2,
                       what="rejoined")
        await _routes(client, "d", 4)
        assert replicas[0].decisions() == 2
    finally:
        await book.close()
        await pool.close()
        for r in replicas:
            await r.stop()
        for lease in workers:
            await lease.close()
        await nc.close()
