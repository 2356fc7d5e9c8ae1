"""Where to reach a role: a fixed address from the config, or the live instances that
discovery lists, kept current by a watch task the book owns. Also the gRPC channel pool.

Used by the processor (to find routers) and the frontend (to find processors and to know
whether the cluster is ready).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection
from typing import Any, TypeVar

import grpc
import nats.errors

from services.common.discovery import Discovery, Registration
from services.common.service import cancel_and_wait

S = TypeVar("S")

log = logging.getLogger(__name__)


class AddressBook:
    """Live instances of one role. ``pick()`` returns an address round-robin, or None."""

    def __init__(self, role: str, fixed: str | None = None) -> None:
        self.role = role
        self._fixed = fixed
        self._instances: dict[str, Registration] = {}
        self._rr = 0
        self._task: asyncio.Task[None] | None = None
        self.on_change: Callable[[], None] | None = None

    @property
    def instances(self) -> dict[str, Registration]:
        return dict(self._instances)

    def get(self, instance_id: str) -> Registration | None:
        return self._instances.get(instance_id)

    def joined(self, reg: Registration) -> None:
        self._instances[reg.instance_id] = reg
        if self.on_change is not None:
            self.on_change()

    def left(self, instance_id: str) -> None:
        self._instances.pop(instance_id, None)
        if self.on_change is not None:
            self.on_change()

    def addresses(self) -> list[str]:
        if self._fixed:
            return [self._fixed]
        return sorted(r.address for r in self._instances.values() if r.address)

    def __len__(self) -> int:
        return 1 if self._fixed else len(self._instances)

    def pick(self, skip: Collection[str] = ()) -> str | None:
        """The next address round-robin, passing over those in ``skip``; None if none is left."""
        addrs = self.addresses()
        if skip:
            addrs = [a for a in addrs if a not in skip]
        if not addrs:
            return None
        self._rr += 1
        return addrs[self._rr % len(addrs)]

    def start(self, discovery: Discovery) -> None:
        """Follow discovery for this role (a fixed address is never replaced)."""
        if self._task is not None:
            raise RuntimeError(f"address book for {self.role!r} already started")
        self._task = asyncio.create_task(self._watch(discovery), name=f"watch {self.role}")
        self._task.add_done_callback(_log_death)

    async def close(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None

    async def _watch(self, discovery: Discovery) -> None:
        while True:
            # A restarted watch replays every live instance as a join: start from scratch.
            self._instances.clear()
            try:
                async for ev in discovery.watch(self.role):
                    if ev.kind == "join":
                        self.joined(ev.registration)
                    else:
                        self.left(ev.registration.instance_id)
            except (TimeoutError, nats.errors.Error) as e:
                log.warning("discovery watch of %s failed (%s); restarting", self.role, e)
                await asyncio.sleep(0.5)


class ChannelPool:
    """One insecure gRPC channel per address, created on first use, closed together."""

    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[tuple[str, Callable[[grpc.aio.Channel], Any]], Any] = {}

    def get(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = grpc.aio.insecure_channel(address)
        return ch

    def stub(self, address: str, stub_cls: Callable[[grpc.aio.Channel], S]) -> S:
        """``stub_cls`` over the address's channel, built once (a stub builds a callable per
        method, which is not worth repeating on every request)."""
        key = (address, stub_cls)
        s = self._stubs.get(key)
        if s is None:
            s = self._stubs[key] = stub_cls(self.get(address))
        return s

    async def close(self) -> None:
        self._stubs = {}
        channels, self._channels = list(self._channels.values()), {}
        for ch in channels:
            await ch.close()


def _log_death(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("%s died: %r", task.get_name(), task.exception())
