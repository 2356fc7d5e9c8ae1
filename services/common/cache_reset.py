"""A prefix-cache reset across the cluster: one NATS request on ``{ns}.cache.reset``, a reply
from every decode and prefill worker.

Benchmark tools reset the cache between runs so that each starts cold (aiperf's
``--reset-kv-cache`` posts vLLM's ``/reset_prefix_cache``, which the frontend serves). A
worker evicts every cached block no live request references, on its engine's step thread
between steps, and answers with the count (``CacheResetResponder``); the evictions reach
the router as ordinary ``KvRemoved`` events, so its index forgets them too. The frontend
asks and waits until every worker discovery lists has answered (``reset_prefix_caches``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass

import nats.errors
from nats.aio.msg import Msg
from prometheus_client import CollectorRegistry, Counter

from services.api.wire import CacheResetReply, WireError, decode_cache_reset, encode_cache_reset
from services.common.nats_client import NatsClient, Subjects

log = logging.getLogger(__name__)

# (blocks evicted, blocks live requests still hold): AsyncEngine.reset_prefix_cache
ResetFn = Callable[[], Awaitable[tuple[int, int]]]


class CacheResetResponder:
    """A worker's side: evict on request and answer. ``start()`` / ``close()``. Counts its
    resets and the blocks they evicted in ``registry`` (the worker's /metrics)."""

    def __init__(self, nc: NatsClient, subjects: Subjects, worker_id: str, role: str,
                 reset: ResetFn, registry: CollectorRegistry | None = None) -> None:
        self._nc, self._subject = nc, subjects.cache_reset
        self.worker_id, self.role = worker_id, role
        self._reset = reset
        self._sub = None
        r = registry if registry is not None else CollectorRegistry()
        self.resets = Counter("tandem_worker_prefix_cache_resets_total",
                              "Prefix-cache resets done on request (POST /reset_prefix_cache)",
                              registry=r)
        self.evicted = Counter("tandem_worker_prefix_cache_reset_evicted_blocks_total",
                               "Cached KV blocks those resets evicted", registry=r)

    async def start(self) -> None:
        self._sub = await self._nc.subscribe(self._subject, cb=self._on_reset)

    async def close(self) -> None:
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception as e:  # the connection may already be gone at shutdown
                log.debug("cache reset unsubscribe: %s", e)
            self._sub = None

    async def _on_reset(self, msg: Msg) -> None:
        if not msg.reply:
            return  # nobody to tell: a reset is only done when asked for an answer
        try:
            evicted, in_use = await self._reset()
        except Exception:
            log.exception("prefix cache reset of %s failed", self.worker_id)
            return  # the asker counts this worker as missing
        self.resets.inc()
        self.evicted.inc(evicted)
        log.info("prefix cache reset: %s evicted %d blocks; %d in use kept", self.worker_id,
                 evicted, in_use)
        await msg.respond(encode_cache_reset(CacheResetReply(self.worker_id, self.role, evicted, in_use)))


@dataclass(frozen=True, slots=True)
class CacheResetResult:
    replies: list[CacheResetReply]  # by worker id
    missing: list[str]  # workers expected (listed in discovery) that did not answer in time


async def reset_prefix_caches(nc: NatsClient, subjects: Subjects, expected: Collection[str],
                              timeout_s: float) -> CacheResetResult:
    """Ask every worker to reset; return once each of ``expected`` answered or at the timeout.

    Answers from workers not in ``expected`` (one that joined meanwhile) are kept too."""
    want = set(expected)
    got: dict[str, CacheResetReply] = {}
    if want:
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        try:
            await nc.publish(subjects.cache_reset, b"", reply=inbox)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout_s
            while not want <= got.keys():
                left = deadline - loop.time()
                if left <= 0:
                    break
                try:
                    msg = await sub.next_msg(timeout=left)
                except nats.errors.TimeoutError:
                    break
                try:
                    r = decode_cache_reset(msg.data)
                except WireError as e:
                    log.warning("ignoring a malformed cache reset reply: %s", e)
                    continue
                got[r.worker_id] = r
        finally:
            await sub.unsubscribe()
    return CacheResetResult([got[k] for k in sorted(got)], sorted(want - got.keys()))
