"""The cluster-wide prefix-cache reset over a real nats-server: every worker that answers is
counted, one that does not (or fails) is named as missing at the timeout, and a reply that is
not one is ignored."""

from __future__ import annotations

import asyncio
import time

import nats
from prometheus_client import CollectorRegistry

from services.common.cache_reset import CacheResetResponder, reset_prefix_caches
from services.common.nats_client import Subjects

S = Subjects("t")


def evicting(n: int, in_use: int = 0, calls: list[str] | None = None):
    async def reset() -> tuple[int, int]:
        if calls is not None:
            calls.append("reset")
        return n, in_use
    return reset


async def test_every_worker_answers_and_is_counted(nats_url: str) -> None:
    nc_w, nc_f = await nats.connect(nats_url), await nats.connect(nats_url)
    calls: list[str] = []
    reg = CollectorRegistry()
    workers = [CacheResetResponder(nc_w, S, "decode-0", "decode", evicting(5, 2, calls), reg),
               CacheResetResponder(nc_w, S, "decode-1", "decode", evicting(0, 0, calls)),
               CacheResetResponder(nc_w, S, "prefill-0", "prefill", evicting(7, 0, calls))]
    try:
        for w in workers:
            await w.start()
        await nc_w.flush()
        t0 = time.monotonic()
        r = await reset_prefix_caches(nc_f, S, ["decode-0", "decode-1", "prefill-0"], timeout_s=10)
        assert time.monotonic() - t0 < 5  # returned on the last answer, not at the timeout
        assert r.missing == [] and len(calls) == 3
        assert [(x.worker_id, x.role, x.evicted_blocks, x.blocks_in_use) for x in r.replies] == [
            ("decode-0", "decode", 5, 2), ("decode-1", "decode", 0, 0), ("prefill-0", "prefill", 7, 0)]
        assert reg.get_sample_value("tandem_worker_prefix_cache_resets_total") == 1
        assert reg.get_sample_value("tandem_worker_prefix_cache_reset_evicted_blocks_total") == 5
        # a publish without a reply subject resets nothing: a reset is done only when asked
        await nc_f.publish(S.cache_reset, b"")
        await nc_f.flush()
        await asyncio.sleep(0.2)
        assert len(calls) == 3
    finally:
        for w in workers:
            await w.close()
        await nc_w.close()
        await nc_f.close()


async def test_silent_failing_and_garbage_answers_leave_workers_missing(nats_url: str) -> None:
    nc_w, nc_f = await nats.connect(nats_url), await nats.connect(nats_url)

    async def broken() -> tuple[int, int]:
        raise RuntimeError("engine is not running")

    async def garbage(msg) -> None:
        await msg.respond(b"\xc1 not a reply")

    ok = CacheResetResponder(nc_w, S, "decode-0", "decode", evicting(1))
    bad = CacheResetResponder(nc_w, S, "decode-1", "decode", broken)
    await ok.start()
    await bad.start()
    sub = await nc_w.subscribe(S.cache_reset, cb=garbage)
    await nc_w.flush()
    try:
        t0 = time.monotonic()
        r = await reset_prefix_caches(nc_f, S, ["decode-0", "decode-1", "decode-9"], timeout_s=0.5)
        assert time.monotonic() - t0 >= 0.5
        assert [x.worker_id for x in r.replies] == ["decode-0"]
        assert r.missing == ["decode-1", "decode-9"]
        # nobody listed: no request is sent and nothing is waited for
        empty = await reset_prefix_caches(nc_f, S, [], timeout_s=30)
        assert empty.replies == [] and empty.missing == []
    finally:
        await sub.unsubscribe()
        await ok.close()
        await bad.close()
        await nc_w.close()
        await nc_f.close()
