"""One part's life, shared by every `tandem <part>` process; a part's serve.py only declares
what it has (a ``PartSpec``) from what it builds.

The order, the same for every part:

1. the NATS connection (named after the instance), then the part's ``build``: its engine,
   servicer, publishers. Whatever ``build`` enters or hands to ``on_close`` is closed in
   reverse order at the end, the connection last;
2. the signal handlers, before any port opens: `tandem up` (or any orchestrator) calls a
   part ready the moment its port accepts and may stop it right then (see stop_on_signals);
3. the serving port (gRPC or HTTP), then /metrics;
4. ``before_register`` (start pulling work, check peers), the discovery record, the part's
   ready line;
5. at SIGTERM/SIGINT (or ``stop``): deregister first, so nothing new is routed here; drain
   for the part's grace; stop the server; flush NATS; close in reverse order.

Every step after the signal is bounded: a part exits within its grace plus
``STEP_TIMEOUT_S`` per step, whatever a peer or an RPC that never ends does.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar
from wsgiref.simple_server import WSGIServer

import grpc
from prometheus_client import CollectorRegistry, start_http_server

from services.common import env
from services.common.config import ClusterConfig
from services.common.discovery import Discovery, Registration
from services.common.nats_client import NatsClient, connect
from services.common.service import cancel_and_wait, stop_on_signals

log = logging.getLogger("tandem.lifecycle")

T = TypeVar("T")

# NOTE: a step after the signal (deregistering, a close, the NATS flush) that takes longer
# than this is abandoned with a warning: a stuck peer must not keep the process, and its
# ports, past what `tandem up`'s --stop-timeout and the tests wait.
STEP_TIMEOUT_S = 2.0
# what the server's stop gets beyond the part's own drain (RPCs cancelled at the grace end)
STOP_MARGIN_S = 1.0
# the server's grace once the part's own drain step has run: what is left is cancelled
AFTER_DRAIN_GRACE_S = 0.5


class Listener(Protocol):
    """A part's open serving port."""

    port: int

    async def stop(self, grace_s: float) -> None:
        """Refuse new calls, let running ones go on up to ``grace_s``, then end them."""
        ...


@dataclass
class GrpcListener:
    server: grpc.aio.Server
    port: int

    async def stop(self, grace_s: float) -> None:
        await self.server.stop(grace_s)


Open = Callable[[str, int], Awaitable[Listener]]  # (bind host, port; 0 = any) -> listener


@dataclass(frozen=True)
class Bound:
    """Where a started part is reachable, as discovery publishes it."""

    address: str  # host:port of its serving port, "" without one
    port: int | None
    metrics_port: int | None


@dataclass
class PartSpec:
    """What a part has; ``run`` owns what happens to it.

    ``open`` the serving port at ``port`` (None: the part serves only /metrics);
    ``registry`` on ``metrics_port`` (None: /metrics is on the serving port); peers dial
    ``advertise_host``. ``grace_s``: how long in-flight work may run after the signal, in
    ``drain`` if the part has one, else in the server's own stop.
    """

    advertise_host: str
    grace_s: float
    open: Open | None = None
    port: int = 0
    registry: CollectorRegistry | None = None
    metrics_port: int | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    drain: Callable[[float], Awaitable[None]] | None = None
    before_register: Callable[[Bound], Awaitable[None]] | None = None
    announce: Callable[[Bound], None] | None = None  # the ready line


class Setup:
    """What a part's ``build`` gets: the config, its names, the NATS connection, and the
    place to leave what must be closed at the end."""

    def __init__(self, cfg: ClusterConfig, role: str, replica: int, host: str,
                 nc: NatsClient, stop: asyncio.Event, stack: AsyncExitStack,
                 instance: str | None = None) -> None:
        self.cfg, self.role, self.replica, self.host = cfg, role, replica, host
        self.instance = instance or f"{role}-{replica}"
        self.nc = nc
        # NOTE: set by SIGTERM/SIGINT only once the ports are about to open; a part may set
        # it itself (a TP rank's death) to stop like a signal would
        self.stop = stop
        self._stack = stack
        self._discovery: Discovery | None = None

    async def enter(self, cm: AbstractAsyncContextManager[T]) -> T:
        """Enter ``cm`` now, exit it at the end (after what is entered later)."""
        return await self._stack.enter_async_context(cm)

    def on_close(self, close: Callable[[], Awaitable[Any] | Any], what: str = "") -> None:
        """Call ``close`` at the end (before what was handed over earlier), bounded by
        ``STEP_TIMEOUT_S`` when it is a coroutine."""
        self._stack.push_async_callback(_bounded, close, what or getattr(close, "__qualname__", "close"),
                                        self.instance)

    def task(self, coro: Awaitable[None], name: str) -> asyncio.Task[None]:
        """A background task owned by the part: cancelled at the end."""
        t = asyncio.ensure_future(coro)
        t.set_name(name)
        self._stack.push_async_callback(cancel_and_wait, t)
        return t

    async def discovery(self) -> Discovery:
        if self._discovery is None:
            self._discovery = await Discovery.open(self.nc, self.cfg.namespace, self.cfg.discovery)
        return self._discovery


Build = Callable[[Setup], Awaitable[PartSpec]]


async def run(cfg: ClusterConfig, role: str, replica: int, build: Build, *, host: str | None = None,
              stop: asyncio.Event | None = None, started: asyncio.Event | None = None,
              nats_no_echo: bool = False) -> None:
    """One part until SIGTERM/SIGINT, or until ``stop`` is set when the caller owns the
    signals (several parts in one process); ``started`` is set once it is registered.
    ``nats_no_echo``: NATS does not deliver the part's own publishes back to it."""
    host = cfg.bind_host if host is None else host
    own_signals = stop is None
    stop = asyncio.Event() if stop is None else stop
    async with AsyncExitStack() as stack:
        # NOTE: pods of one Deployment share their command (all --replica 0): each takes its
        # pod's name as instance id (TANDEM_INSTANCE_ID), its ports stay base + replica
        instance = env.instance_id() or f"{role}-{replica}"
        nc = await connect(cfg.nats, instance, no_echo=nats_no_echo)
        stack.push_async_callback(_bounded, nc.close, "NATS close", instance)
        setup = Setup(cfg, role, replica, host, nc, stop, stack, instance)
        spec = await build(setup)
        if own_signals:
            stop_on_signals(stop)
        listener = await spec.open(host, spec.port) if spec.open is not None else None
        try:
            if spec.metrics_port is not None and spec.registry is not None:
                metrics, _ = start_http_server(spec.metrics_port, registry=spec.registry, addr=host)
                setup.on_close(lambda: asyncio.to_thread(_close_http, metrics), "metrics server")
            bound = _bound(spec, listener)
            if spec.before_register is not None:
                await spec.before_register(bound)
            disc = await setup.discovery()
            lease = await disc.register(Registration(
                role, setup.instance, address=bound.address,
                metrics_address=(f"{spec.advertise_host}:{bound.metrics_port}"
                                 if bound.metrics_port is not None else bound.address),
                metadata=spec.metadata))
        except BaseException:
            if listener is not None:
                await _bounded(listener.stop, "server stop", setup.instance, 0)
            raise
        if spec.announce is not None:
            spec.announce(bound)
        if started is not None:
            started.set()
        try:
            await stop.wait()
            log.info("%s: deregistering, then draining (up to %.1fs)", setup.instance, spec.grace_s)
        finally:
            # NOTE: every step runs even when one before it fails (a drain that raises after
            # a TP rank's death): a gRPC server never stopped is finalized after the loop
            # closes, and the process ends with a traceback instead of its one error line
            await _run_all(setup.instance,
                           lambda: _bounded(lease.close, "deregistration", setup.instance),
                           lambda: _drain(spec, listener, setup.instance),
                           # what the drained requests published last (the router's in-flight reports)
                           lambda: _bounded(nc.flush, "NATS flush", setup.instance))


async def run_many(cfg: ClusterConfig, role: str, first: int, count: int, build: Build) -> None:
    """Replicas ``first .. first+count-1`` of a part in one process, each a full part (own
    ports, discovery record); one signal stops them all."""
    if count > 1 and env.instance_id():
        raise ValueError(f"{env.INSTANCE_ID} names one instance: it cannot name {count} in one process")
    stop = stop_on_signals()
    tasks: list[asyncio.Task[None]] = []
    try:
        for i in range(count):
            # NOTE: one at a time: building an engine blocks the event loop, and with K
            # building at once the others' NATS requests time out.
            up = asyncio.Event()
            tasks.append(asyncio.create_task(run(cfg, role, first + i, build, stop=stop, started=up)))
            waiter = asyncio.create_task(up.wait())
            await asyncio.wait([tasks[-1], waiter], return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            if tasks[-1].done():
                tasks[-1].result()  # it failed to start: raise its error
        await asyncio.gather(*tasks)
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)


def _close_http(server: WSGIServer) -> None:
    server.shutdown()  # NOTE: blocks until its serving thread has seen it (0.5 s polls)
    server.server_close()


def _bound(spec: PartSpec, listener: Listener | None) -> Bound:
    address = f"{spec.advertise_host}:{listener.port}" if listener is not None else ""
    return Bound(address, listener.port if listener is not None else None, spec.metrics_port)


async def _drain(spec: PartSpec, listener: Listener | None, instance: str) -> None:
    """The part's own drain with its grace, then the server's stop: with the grace when the
    server's stop is the drain, briefly after the part's own."""
    grace = spec.grace_s
    try:
        if spec.drain is not None:
            await _bounded(spec.drain, "drain", instance, grace + STOP_MARGIN_S, grace)
            grace = AFTER_DRAIN_GRACE_S
    finally:
        if listener is not None:
            await _bounded(listener.stop, "server stop", instance, grace + STOP_MARGIN_S, grace)


async def _run_all(instance: str, *steps: Callable[[], Awaitable[None]]) -> None:
    """Each step in turn whatever the ones before it raised; the first error is raised at
    the end, the later ones logged."""
    first: BaseException | None = None
    for step in steps:
        try:
            await step()
        except Exception as e:
            if first is None:
                first = e
            else:
                log.warning("%s: shutdown step failed after an earlier one: %r", instance, e)
    if first is not None:
        raise first


async def _bounded(step: Callable[..., Awaitable[Any] | Any], what: str, instance: str,
                   timeout_s: float = STEP_TIMEOUT_S, *args: Any) -> None:
    """``step(*args)``, awaited for at most ``timeout_s``; one that overruns is abandoned
    with a warning. Its errors are raised (a TP rank's failure makes the exit non-zero)."""
    result = step(*args)
    if not inspect.isawaitable(result):
        return
    task = asyncio.ensure_future(result)
    done, _ = await asyncio.wait([task], timeout=timeout_s)
    if not done:
        log.warning("%s: %s did not end in %.1fs; going on without it", instance, what, timeout_s)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(cancel_and_wait(task), STEP_TIMEOUT_S)
        return
    task.result()
