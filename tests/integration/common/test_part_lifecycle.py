"""The shared part lifecycle (services/common/lifecycle.py) on a real nats-server, with a
part declared here: registered once its port is open, deregistered before its drain, what it
handed over closed in reverse order, and a shutdown bounded by the grace even when the
server's stop never ends (an RPC that never finishes)."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.common import lifecycle
from services.common.config import parse_config
from services.common.discovery import Discovery
from services.common.lifecycle import Bound, PartSpec, Setup
from services.common.nats_client import connect


class _Port:
    """A listener whose stop waits ``stop_takes_s`` (forever: None)."""

    def __init__(self, port: int, events: list[str], stop_takes_s: float | None) -> None:
        self.port, self._events, self._takes = port, events, stop_takes_s

    async def stop(self, grace_s: float) -> None:
        self._events.append(f"server stop {grace_s:g}")
        await (asyncio.sleep(self._takes) if self._takes is not None else asyncio.Event().wait())


def _part(events: list[str], disc: Discovery, *, stop_takes_s: float | None = 0.0,
          with_drain: bool = True, grace_s: float = 1.0):
    async def build(part: Setup) -> PartSpec:
        part.on_close(lambda: events.append("closed first handed"), "first")
        part.on_close(lambda: events.append("closed last handed"), "last")

        async def open_port(host: str, port: int) -> _Port:
            events.append(f"open {host}:{port}")
            return _Port(port, events, stop_takes_s)

        async def before_register(bound: Bound) -> None:
            events.append(f"before register {bound.address}")

        async def drain(grace: float) -> None:
            live = [r.instance_id for r in await disc.registrations("thing")]
            events.append(f"drain {grace:g}, registered: {live}")

        return PartSpec("10.0.0.7", grace_s, open=open_port, port=4000 + part.replica,
                        metadata={"k": "v"}, drain=drain if with_drain else None,
                        before_register=before_register,
                        announce=lambda b: events.append(f"ready {b.address}"))

    return build


async def _started(task: asyncio.Task[None], started: asyncio.Event) -> None:
    waiter = asyncio.create_task(started.wait())
    await asyncio.wait([task, waiter], timeout=30, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    if task.done():
        task.result()
    assert started.is_set(), "the part never registered"


async def test_order_from_open_to_close(nats_url: str) -> None:
    cfg = parse_config({}, [f"nats.url={nats_url}", "namespace=lifecycle1"])
    nc = await connect(cfg.nats, "test")
    try:
        disc = await Discovery.open(nc, cfg.namespace, cfg.discovery)
        events: list[str] = []
        stop, started = asyncio.Event(), asyncio.Event()
        task = asyncio.create_task(lifecycle.run(cfg, "thing", 2, _part(events, disc), host="127.0.0.1",
                                                 stop=stop, started=started))
        await _started(task, started)
        [reg] = await disc.registrations("thing")
        assert (reg.instance_id, reg.address, reg.metrics_address, reg.metadata) == (
            "thing-2", "10.0.0.7:4002", "10.0.0.7:4002", {"k": "v"})
        stop.set()
        await asyncio.wait_for(task, 10)
        assert events == [
            "open 127.0.0.1:4002", "before register 10.0.0.7:4002", "ready 10.0.0.7:4002",
            "drain 1, registered: []",  # deregistered before the drain
            f"server stop {lifecycle.AFTER_DRAIN_GRACE_S:g}",
            "closed last handed", "closed first handed",
        ]
    finally:
        await nc.close()


@pytest.mark.parametrize("with_drain", [True, False])
async def test_a_server_stop_that_never_ends_is_bounded(nats_url: str, with_drain: bool) -> None:
    cfg = parse_config({}, [f"nats.url={nats_url}", f"namespace=lifecycle-{with_drain}"])
    nc = await connect(cfg.nats, "test")
    try:
        disc = await Discovery.open(nc, cfg.namespace, cfg.discovery)
        events: list[str] = []
        stop, started = asyncio.Event(), asyncio.Event()
        task = asyncio.create_task(lifecycle.run(
            cfg, "thing", 0, _part(events, disc, stop_takes_s=None, with_drain=with_drain, grace_s=1.0),
            host="127.0.0.1", stop=stop, started=started))
        await _started(task, started)
        t0 = time.monotonic()
        stop.set()
        await asyncio.wait_for(task, 20)
        took = time.monotonic() - t0
        bound = 1.0 + lifecycle.STOP_MARGIN_S + 2 * lifecycle.STEP_TIMEOUT_S
        assert took < bound, f"stopped in {took:.1f}s, more than {bound:.1f}s"
        assert events[-2:] == ["closed last handed", "closed first handed"]
        assert await disc.registrations("thing") == []
    finally:
        await nc.close()


async def test_an_instance_id_from_the_environment_keeps_the_replica_ports(
        nats_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # a Kubernetes pod: every pod of a Deployment runs --replica 0, each its own name
    monkeypatch.setenv("TANDEM_INSTANCE_ID", "thing-7d9f8c-x2x4q")
    cfg = parse_config({}, [f"nats.url={nats_url}", "namespace=lifecycle3"])
    nc = await connect(cfg.nats, "test")
    try:
        disc = await Discovery.open(nc, cfg.namespace, cfg.discovery)
        stop, started = asyncio.Event(), asyncio.Event()
        task = asyncio.create_task(lifecycle.run(cfg, "thing", 0, _part([], disc), host="127.0.0.1",
                                                 stop=stop, started=started))
        await _started(task, started)
        [reg] = await disc.registrations("thing")
        assert (reg.instance_id, reg.address) == ("thing-7d9f8c-x2x4q", "10.0.0.7:4000")
        stop.set()
        await asyncio.wait_for(task, 10)
        with pytest.raises(ValueError, match="cannot name 2 in one process"):
            await lifecycle.run_many(cfg, "thing", 0, 2, _part([], disc))
    finally:
        await nc.close()
