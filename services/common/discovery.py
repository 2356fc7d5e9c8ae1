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
import nats.js.errors
from nats.aio.msg import Msg
from nats.js.errors import BucketNotFoundError
from nats.js.kv import KV_DEL, KV_OP, KV_PURGE, KeyValue

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
            except (TimeoutError, nats.errors.Error) as e:
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
            except (TimeoutError, nats.errors.Error) as e:
                log.warning("discovery delete of %s failed (TTL will expire it): %s",
                            self.registration.key, e)


class Discovery:
    """The discovery bucket of one namespace. Create with ``await Discovery.open(...)``."""

    def __init__(self, kv: KeyValue, cfg: DiscoveryConfig, nc: NatsClient, namespace: str) -> None:
        self._kv = kv
        self._cfg = cfg
        self._nc = nc
        self._subjects = Subjects(namespace)

    @classmethod
    async def open(cls, nc: NatsClient, namespace: str, cfg: DiscoveryConfig) -> Discovery:
        js = nc.jetstream()
        bucket = Subjects(namespace).discovery_bucket
        try:
            kv = await js.key_value(bucket)
        except BucketNotFoundError:
            kv = await js.create_key_value(bucket=bucket, ttl=cfg.ttl_s, history=1)
        return cls(kv, cfg, nc, namespace)

    async def register(self, reg: Registration) -> Lease:
        lease = Lease(self._kv, reg, self._cfg.heartbeat_s)
        await lease._start()
        return lease

    async def registrations(self, role: str) -> list[Registration]:
        """Every live instance of ``role`` now (a snapshot; ``watch`` follows changes)."""
        out = []
        for value in (await self._current(role)).values():
            try:
                out.append(Registration.from_bytes(value))
            except ValueError:
                continue
        return out

    async def _current(self, role: str) -> dict[str, bytes]:
        """key -> value of every live key of ``role`` (deleted ones left out)."""
        s = self._subjects
        prefix = s.discovery_key(role, "")
        info = await self._nc.jetstream().stream_info(s.discovery_stream, subjects_filter=prefix + "*")
        out: dict[str, bytes] = {}
        for subject in (info.state.subjects or {}):
            key = f"{role}.{subject[len(prefix):]}"
            try:
                entry = await self._kv.get(key)
            except nats.js.errors.NotFoundError:  # deleted, or expired since the listing
                continue
            out[key] = entry.value or b""
        return out

    async def watch(self, role: str) -> AsyncIterator[DiscoveryEvent]:
        """Yield a join for every live instance of ``role`` (current ones first), then joins
        and leaves as they happen, until the caller stops iterating.

        NOTE: the updates come from a plain subscription to the bucket's subjects (every put
        and delete is a message there) and the current keys from request/reply gets, not
        from a JetStream consumer: creating consumers is a permission no part is given
        (nats_client.role_permissions says why).
        """
        live: asyncio.Queue[tuple[str, bytes | None]] = asyncio.Queue()
        prefix = self._subjects.discovery_key(role, "")

        async def on_msg(msg: Msg) -> None:
            op = (msg.headers or {}).get(KV_OP)
            live.put_nowait((f"{role}.{msg.subject[len(prefix):]}",
                             None if op in (KV_DEL, KV_PURGE) else msg.data))

        # Subscribe before reading the current keys so nothing between the two is missed.
        sub = await self._nc.subscribe(prefix + "*", cb=on_msg)
        ttl = self._cfg.ttl_s
        sweep = min(self._cfg.heartbeat_s, ttl / 4)
        known: dict[str, tuple[Registration, float]] = {}
        try:
            now = time.monotonic()
            for key, value in (await self._current(role)).items():
                event = _update(known, key, value, now)
                if event is not None:
                    yield event
            while True:
                try:
                    item: tuple[str, bytes | None] | None = await asyncio.wait_for(live.get(), sweep)
                except TimeoutError:
                    item = None
                now = time.monotonic()
                if item is not None:
                    event = _update(known, item[0], item[1], now)
                    if event is not None:
                        yield event
                for key, (reg, seen) in list(known.items()):
                    if now - seen > ttl:
                        del known[key]
                        yield DiscoveryEvent("leave", reg)
        finally:
            try:
                await sub.unsubscribe()
            except Exception as e:  # the connection may already be closed at shutdown
                log.debug("discovery watch unsubscribe: %s", e)


def _update(known: dict[str, tuple[Registration, float]], key: str, value: bytes | None,
            now: float) -> DiscoveryEvent | None:
    """Apply one put (``value``) or delete (None) of ``key`` to ``known``; the event it
    makes, if any (a re-put of the same registration is only a heartbeat)."""
    if value is None:
        gone = known.pop(key, None)
        return DiscoveryEvent("leave", gone[0]) if gone is not None else None
    try:
        reg = Registration.from_bytes(value)
    except ValueError as e:
        log.warning("ignoring bad discovery entry %s: %s", key, e)
        return None
    old = known.get(key)
    known[key] = (reg, now)
    return DiscoveryEvent("join", reg) if old is None or old[0] != reg else None
