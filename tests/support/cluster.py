"""A whole cluster in one event loop, every hop real: nats-server (from the fixture), the
Router served over gRPC, the real decode worker (mock-runner engine) registered in discovery,
the Processor over gRPC finding the router through discovery, and the frontend on uvicorn
finding the processor through discovery."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import uvicorn

from services.common.address_book import AddressBook, ChannelPool
from services.common.config import ClusterConfig
from services.common.discovery import Discovery, Lease, Registration
from services.common.grpc_server import serve_grpc
from services.common.nats_client import connect
from services.frontend.app import create_app
from services.frontend.http_server import Server
from services.frontend.readiness import ClusterReadiness
from services.model.tokenizer import Tokenizer
from services.processor.client import ProcessorClient
from services.processor.context import context_length
from services.processor.grpc_server import serve_processor
from services.processor.processor import Processor
from services.processor.router_client import RouterClient
from services.processor.router_reports import inflight_publisher
from services.router.grpc_server import RouterServicer
from services.router.router import Router
from tests.support.ports import free_port
from tests.support.stack import DecodeNode, make_processor, worker_decode_node

log = logging.getLogger(__name__)

# NOTE: a NATS server that stops reading (a starved CI machine) leaves nats-py's close and
# unsubscribe waiting on a socket drain for ever; a teardown step past this is abandoned
TEARDOWN_STEP_S = 15.0


class BoundedStack(AsyncExitStack):
    """An AsyncExitStack whose callbacks each get ``TEARDOWN_STEP_S``: one step stuck on a
    wedged peer is logged and skipped, not the rest of the suite's time."""

    def push_async_callback(self, callback: Callable[..., Awaitable[Any]], /, *args: Any,
                            **kwds: Any) -> Callable[..., Awaitable[Any]]:
        async def bounded() -> None:
            try:
                await asyncio.wait_for(callback(*args, **kwds), TEARDOWN_STEP_S)
            except TimeoutError:
                log.warning("teardown: %r did not end in %.0fs; going on", callback, TEARDOWN_STEP_S)

        super().push_async_callback(bounded)
        return callback


@dataclass
class Cluster:
    cfg: ClusterConfig
    url: str  # http://127.0.0.1:PORT
    router: Router
    discovery: Discovery
    node: DecodeNode
    decode_lease: Lease | None
    processor: Processor

    async def register_decode(self) -> None:
        self.decode_lease = await self.discovery.register(
            Registration("decode", "w0", address=self.node.address))

    async def wait_router_released(self, worker: str = "w0") -> None:
        """The processor's FINISHED reports travel over NATS: poll (bounded) until the
        router counts nothing in flight on ``worker``."""
        for _ in range(500):
            if self.router.load.inflight_count(worker) == 0:
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"the router still counts {self.router.load.inflight_count(worker)} "
                             f"requests in flight on {worker}")

    async def wait_ready(self) -> None:
        for _ in range(500):
            if "w0" in self.router.workers:
                return
            await asyncio.sleep(0.02)
        raise AssertionError("the router never saw the decode worker")


@asynccontextmanager
async def running_cluster(cfg: ClusterConfig, tok: Tokenizer, with_decode: bool = True,
                          node_factory: Callable[[], AbstractAsyncContextManager[DecodeNode]]
                          | None = None) -> AsyncIterator[Cluster]:
    """``node_factory``: the decode node to run (default: the real decode worker over the
    mock-runner engine)."""
    async with BoundedStack() as stack:
        nc = await connect(cfg.nats, "test-cluster")
        stack.push_async_callback(nc.close)
        disc = await Discovery.open(nc, cfg.namespace, cfg.discovery)
        pool = ChannelPool()
        stack.push_async_callback(pool.close)

        router = Router(cfg)
        await router.start()
        stack.push_async_callback(router.close)
        rserver, rport = await serve_grpc("router", "127.0.0.1", 0, RouterServicer(router).add_to)
        stack.push_async_callback(rserver.stop, 0)
        lease = await disc.register(Registration("router", "r0", address=f"127.0.0.1:{rport}"))
        stack.push_async_callback(lease.close)

        factory = node_factory or (lambda: worker_decode_node(cfg, tok))
        node = await stack.enter_async_context(factory())

        routers = AddressBook("router")
        routers.start(disc)
        stack.push_async_callback(routers.close)
        processor = make_processor(cfg, tok, RouterClient(routers, pool), context_length(cfg, None),
                                   pool, publish_reports=inflight_publisher(nc, cfg.namespace))
        pserver, pport = await serve_processor(processor, "127.0.0.1", 0)
        stack.push_async_callback(pserver.stop, 0)
        plane = await disc.register(Registration("processor", "p0", address=f"127.0.0.1:{pport}"))
        stack.push_async_callback(plane.close)

        books = [AddressBook("processor"), AddressBook("router"), AddressBook("decode")]
        for b in books:
            b.start(disc)
            stack.push_async_callback(b.close)
        app = create_app(cfg, ProcessorClient(books[0], pool), ClusterReadiness(*books))
        port = free_port()
        server = Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                        timeout_graceful_shutdown=1))
        task = asyncio.create_task(server.serve())

        async def stop_http() -> None:
            server.should_exit = True
            await task

        stack.push_async_callback(stop_http)
        while not server.started:
            if task.done():
                task.result()
            await asyncio.sleep(0.01)
        cluster = Cluster(cfg, f"http://127.0.0.1:{port}", router, disc, node, None, processor)
        if with_decode:
            await cluster.register_decode()
            await cluster.wait_ready()
        # the processor and frontend must see the router/processor before the first call
        for _ in range(500):
            if routers.addresses() and all(b.addresses() for b in books[:2]):
                break
            await asyncio.sleep(0.02)
        try:
            yield cluster
        finally:
            if cluster.decode_lease is not None:
                await cluster.decode_lease.close()
