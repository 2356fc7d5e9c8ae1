"""Discovery: one key per live instance in a NATS JetStream KV bucket with a TTL.

An instance ``register()``s a ``Registration`` under ``{role}.{instance_id}`` and re-puts it
every ``heartbeat_s``; the bucket's max age (``ttl_s``) drops the key if the heartbeats stop,
and a clean shutdown deletes it. ``watch(role)`` yields join/leave updates.

NOTE: nats-server 2.9 expires KV entries silently: a watcher sees deletes and purges but no
marker when the TTL removes a key (markers came with 2.11). The watcher therefore also
sweeps: an instance not re-put within ``ttl_s`` of the last update it saw is reported as
leaving. Ages are measured on the watcher's clock, so a key can outlive its TTL by at most
one sweep interval plus the delivery delay.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from typing import Literal

import nats.errors
from nats.js.errors import BucketNotFoundError
from nats.js.kv import KeyValue

from services.common.config import DiscoveryConfig
from services.common.nats_client import NatsClient, Subjects
from services.common.service import cancel_and_wait

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Registration:
    """What an instance announces. ``address`` is its gRPC host:port, if it serves one."""

    role: str
    instance_id: str
    address: str = ""
    metrics_address: str = ""
    metadata: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("role", "instance_id"):
            v = getattr(self, name)
            if not v or any(c in v for c in ". *>"):
                raise ValueError(f"Registration.{name} must be non-empty without '.', ' ', '*', '>': {v!r}")

    @property
    def key(self) -> str:
        return f"{self.role}.{self.instance_id}"

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Registration:
        try:
            d = json.loads(data)
            return cls(**d)
        except (ValueError, TypeError) as e:
            raise ValueError(f"not a discovery registration: {e}") from None


@dataclass(frozen=True, slots=True)
class DiscoveryEvent:
    kind: Literal["join", "leave"]
    registration: Registration


class Lease:
    """A registration kept alive by a heartbeat task this object owns; ``close()`` stops it
    and deletes the key (a clean shutdown), so watchers see the leave at once."""

    def __init__(self, kv: KeyValue, reg: Registration, heartbeat_s: float) -> None:
        self.registration = reg
        self._kv = kv
        self._heartbeat_s = heartbeat_s
        self._task: asyncio.Task[None] | None = None

    async def _start(self) -> None:
        await self._kv.put(self.registration.key, self.registration.to_bytes())
        self._task = asyncio.create_task(self._beat(), name=f"heartbeat {self.registration.key}")

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self._heartbeat_s)
            try:
                await self._kv.put(self.registration.key, self.registration.to_bytes())
            except (nats.errors.Error, asyncio.TimeoutError) as e:
                # A NATS outage: keep beating, the client reconnects on its own.
                log.warning("discovery heartbeat for %s failed: %s", self.registration.key, e)

    async def close(self, delete: bool = True) -> None:
        """Stop heartbeating; ``delete=False`` simulates a crash (the TTL will expire it)."""
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
        if delete:
            try:
                await self._kv.delete(self.registration.key)
            except (nats.errors.Error, asyncio.TimeoutError) as e:
                log.warning("discovery delete of %s failed (TTL will expire it): %s",
                            self.registration.key, e)


class Discovery:
    """The discovery bucket of one namespace. Create with ``await Discovery.open(...)``."""

    def __init__(self, kv: KeyValue, cfg: DiscoveryConfig) -> None:
        self._kv = kv
        self._cfg = cfg

    @classmethod
    async def open(cls, nc: NatsClient, namespace: str, cfg: DiscoveryConfig) -> Discovery:
        js = nc.jetstream()
        bucket = Subjects(namespace).discovery_bucket
        try:
            kv = await js.key_value(bucket)
        except BucketNotFoundError:
            kv = await js.create_key_value(bucket=bucket, ttl=cfg.ttl_s, history=1)
        return cls(kv, cfg)

    async def register(self, reg: Registration) -> Lease:
        lease = Lease(self._kv, reg, self._cfg.heartbeat_s)
        await lease._start()
        return lease

    async def watch(self, role: str) -> AsyncIterator[DiscoveryEvent]:
        """Yield a join for every live instance of ``role`` (current ones first), then joins
        and leaves as they happen, until the caller stops iterating."""
        watcher = await self._kv.watch(f"{role}.>")
        ttl = self._cfg.ttl_s
        sweep = min(self._cfg.heartbeat_s, ttl / 4)
        known: dict[str, tuple[Registration, float]] = {}
        try:
            while True:
                try:
                    entry = await watcher.updates(timeout=sweep)
                except nats.errors.TimeoutError:
                    entry = None
                now = time.monotonic()
                if entry is not None:
                    if entry.operation in ("DEL", "PURGE"):
                        gone = known.pop(entry.key, None)
                        if gone is not None:
                            yield DiscoveryEvent("leave", gone[0])
                    else:
                        try:
                            reg = Registration.from_bytes(entry.value or b"")
                        except ValueError as e:
                            log.warning("ignoring bad discovery entry %s: %s", entry.key, e)
                        else:
                            old = known.get(entry.key)
                            known[entry.key] = (reg, now)
                            if old is None or old[0] != reg:
                                yield DiscoveryEvent("join", reg)
                for key, (reg, seen) in list(known.items()):
                    if now - seen > ttl:
                        del known[key]
                        yield DiscoveryEvent("leave", reg)
        finally:
            try:
                await watcher.stop()
            except Exception as e:  # the connection may already be closed at shutdown
                log.debug("discovery watcher stop: %s", e)
