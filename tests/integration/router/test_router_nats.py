"""The router against a real nats-server: events, gaps and dumps, discovery, replicas, bursts,
and what it does with events, load and sessions nobody registered (dropped, bounded, backed off)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from services.api.kv_events import KvCleared, KvEvent, KvStored, StoredBlock
from services.api.route import RequestPhase, RouteRequest
from services.api.wire import WorkerLoad, encode_dump, encode_event_batch, encode_load
from services.common.config import parse_config
from services.common.discovery import Discovery, Lease, Registration
from services.common.hashing import block_hashes, local_block_hashes
from services.common.kv_publisher import KvEventPublisher
from services.common.nats_client import NatsClient, Subjects, connect
from services.processor.router_reports import RouterReports, inflight_publisher
from services.router.router import Router

BS = 4  # small blocks keep prompts short


class FakeWorker:
    """A worker's NATS side for tests: the real publisher + discovery over a cache model that
    is just the list of chains it stored (what the engine's block pool would report)."""

    def __init__(self, nc: NatsClient, ns: str, worker_id: str, disc: Discovery) -> None:
        self.id = worker_id
        self.nc, self.disc = nc, disc
        self.chains: dict[int, KvStored] = {}  # last seq hash -> event
        self.next_id = 1
        self.pub = KvEventPublisher(nc, Subjects(ns), worker_id, self.dump)
        self.lease: Lease | None = None

    def dump(self) -> list[KvEvent]:
        return [KvCleared(self.id, 0), *self.chains.values()]

    async def start(self) -> None:
        await self.pub.start()
        self.lease = await self.disc.register(Registration("decode", self.id, address=f"{self.id}:1"))

    def store(self, tokens: list[int], publish: bool = True) -> None:
        blocks = tuple(StoredBlock(b.seq_hash, b.local_hash) for b in block_hashes(tokens, BS))
        ev = KvStored(self.id, self.next_id, None, blocks)
        self.next_id += 1
        self.chains[blocks[-1].seq_hash] = ev
        if publish:
            self.pub.on_event(ev)
        else:  # lost on the wire: the publisher's id sequence still advances
            self.pub._last_event_id = ev.event_id

    async def close(self, clean: bool = True) -> None:
        await self.pub.close()
        if self.lease is not None:
            await self.lease.close(delete=clean)


def _cfg(url: str, ns: str, **router: object):
    return parse_config({
        "namespace": ns,
        "nats": {"url": url},
        "engine": {"block_size": BS, "max_num_batched_tokens": 64},
        "discovery": {"ttl_s": 1.0, "heartbeat_s": 0.2},
        "router": dict(router),
    })


@pytest.fixture
async def nc(nats_url: str):
    c = await connect(_cfg(nats_url, "x").nats, "test")
    yield c
    await c.close()


SYSTEM = list(range(1000, 1032))  # 8 blocks of 4


async def test_shared_prefix_routes_to_holder_and_dump_syncs_new_router(nc, nats_url, wait_for) -> None:
    ns = "t1"
    disc = await Discovery.open(nc, ns, _cfg(nats_url, ns).discovery)
    a, b = FakeWorker(nc, ns, "wa", disc), FakeWorker(nc, ns, "wb", disc)
    await a.start(), await b.start()
    async with Router(_cfg(nats_url, ns), seed=0) as r:
        await wait_for(lambda: set(r.workers) == {"wa", "wb"}, what="discovery")
        await wait_for(lambda: r.ingest.synced("wa") and r.ingest.synced("wb"), what="initial dumps")
        a.store(SYSTEM + [1, 2, 3, 4])
        b.store([7] * 40)
        await wait_for(lambda: r.index.num_blocks() == 9 + 10, what="events applied")
        resp = await r.route(RouteRequest("q1", SYSTEM + [5, 6, 7, 8, 9]))
        assert (resp.worker_id, resp.overlap_blocks, resp.request_blocks) == ("wa", 8, 9)
        assert resp.prefix_hit_rate == pytest.approx(8 / 9)
        assert resp.address == "wa:1"
        # A replica started later learns the same state from dumps alone.
        async with Router(_cfg(nats_url, ns), seed=1) as r2:
            await wait_for(lambda: r2.ingest.synced("wa") and r2.ingest.synced("wb"), what="dumps")
            assert r2.index.find_matches(local_block_hashes(SYSTEM, BS)).scores == {"wa": 8}
            assert r2.metrics.dumps.labels("ok")._value.get() >= 2
    await a.close(), await b.close()


async def test_gap_triggers_dump_and_index_is_right_after(nc, nats_url, wait_for) -> None:
    ns = "t2"
    disc = await Discovery.open(nc, ns, _cfg(nats_url, ns).discovery)
    w = FakeWorker(nc, ns, "wg", disc)
    await w.start()
    async with Router(_cfg(nats_url, ns)) as r:
        await wait_for(lambda: r.ingest.synced("wg"), what="initial dump")
        w.store([1] * 8)
        await wait_for(lambda: r.index.num_blocks("wg") == 2, what="first event")
        w.store([2] * 12, publish=False)  # lost: id 2 never arrives
        w.store([3] * 16)  # id 3 arrives: a gap
        await wait_for(lambda: r.ingest.last_event_id("wg") == 3 and r.ingest.synced("wg"), what="dump")
        assert r.metrics.gaps._value.get() >= 1
        m = r.index.find_matches
        assert m(local_block_hashes([2] * 12, BS)).scores == {"wg": 3}  # from the dump
        assert m(local_block_hashes([3] * 16, BS)).scores == {"wg": 4}
        assert r.index.num_blocks("wg") == 2 + 3 + 4
        r.index.check_integrity()
    await w.close()


async def test_worker_that_stops_heartbeating_is_dropped(nc, nats_url, wait_for) -> None:
    ns = "t3"
    disc = await Discovery.open(nc, ns, _cfg(nats_url, ns).discovery)
    a, b = FakeWorker(nc, ns, "wa", disc), FakeWorker(nc, ns, "wb", disc)
    await a.start(), await b.start()
    async with Router(_cfg(nats_url, ns)) as r:
        await wait_for(lambda: r.ingest.synced("wa") and r.ingest.synced("wb"), what="sync")
        a.store([5] * 8)
        await wait_for(lambda: r.index.num_blocks("wa") == 2, what="events")
        await a.close(clean=False)  # crash: no delete, the TTL must expire it
        await wait_for(lambda: "wa" not in r.workers, timeout=10, what="TTL drop")
        assert r.index.num_blocks("wa") == 0 and "wa" not in r.index.workers
        assert (await r.route(RouteRequest("q", [5] * 8))).worker_id == "wb"
        await b.close(clean=True)  # clean shutdown: the delete is seen at once
        await wait_for(lambda: not r.workers, what="clean leave")
        with pytest.raises(Exception, match="no decode workers"):
            await r.route(RouteRequest("q2", [5] * 8))


async def test_two_replicas_agree_and_share_inflight(nc, nats_url, wait_for) -> None:
    ns = "t4"
    disc = await Discovery.open(nc, ns, _cfg(nats_url, ns).discovery)
    ws = [FakeWorker(nc, ns, f"w{i}", disc) for i in range(3)]
    for w in ws:
        await w.start()
    async with Router(_cfg(nats_url, ns)) as r1, Router(_cfg(nats_url, ns)) as r2:
        await wait_for(lambda: all(r.ingest.synced(w.id) for r in (r1, r2) for w in ws), what="sync")
        for i, w in enumerate(ws):
            for j in range(4):
                w.store([i * 100 + j] * 4 + [j] * (4 * (i + 1)))
        await wait_for(lambda: r1.index.num_blocks() == r2.index.num_blocks() == 4 * (2 + 3 + 4), what="ingest")
        for i in range(3):
            for j in range(4):
                q = local_block_hashes([i * 100 + j] * 4 + [j] * 12, BS)
                assert r1.index.find_matches(q).scores == r2.index.find_matches(q).scores
        resp = await r1.route(RouteRequest("shared", [9] * 40))
        await wait_for(lambda: r2.load.inflight_count(resp.worker_id) == 1, what="inflight shared")
        assert r2.load.view(resp.worker_id).active_blocks == 10
        await r2.update("shared", RequestPhase.FINISHED)
        await wait_for(lambda: r1.load.inflight_count() == 0, what="free shared")
        # A processor publishes its requests' first token and end on the same subject: both
        # replicas apply them (the routing replica included: its own publishes are not
        # echoed, a processor's are).
        reports = RouterReports(r1, inflight_publisher(nc, ns), sender="processor-0")
        resp = await r1.route(RouteRequest("pub", [7] * 40))
        w = resp.worker_id
        await wait_for(lambda: r2.load.inflight_count(w) == 1, what="inflight shared")
        assert r1.load.view(w).pending_prefill_blocks == r2.load.view(w).pending_prefill_blocks > 0
        await reports.send("pub", RequestPhase.PREFILLED)
        await wait_for(lambda: all(r.load.view(w).pending_prefill_blocks == 0 for r in (r1, r2)),
                       what="published PREFILLED")
        assert r1.load.inflight_count(w) == r2.load.inflight_count(w) == 1
        await reports.send("pub", RequestPhase.FINISHED)
        await wait_for(lambda: r1.load.inflight_count() == r2.load.inflight_count() == 0,
                       what="published FINISHED")
    for w in ws:
        await w.close()


def _spread(mode: str, picks: list[str]) -> None:
    """What a burst on one cached prompt must look like: the holder first; kv: a few workers,
    none taking more than half; ttft: every worker (the holder's queue and decode batch make
    its steps slower than a fresh prefill elsewhere), the holder the most (its prefill is
    the shortest)."""
    assert picks[0] == "w0"  # the holder wins while idle
    if mode == "kv":
        assert len(set(picks)) >= 3, picks
        assert max(picks.count(w) for w in set(picks)) <= 8, picks
    else:
        assert len(set(picks)) == 4, picks
        assert picks.count("w0") == max(picks.count(w) for w in set(picks)), picks


@pytest.mark.parametrize("mode", ["kv", "ttft"])
async def test_burst_sharing_a_system_prompt_spreads(nc, nats_url, wait_for, mode: str) -> None:
    ns = f"t5{mode}"
    disc = await Discovery.open(nc, ns, _cfg(nats_url, ns).discovery)
    ws = [FakeWorker(nc, ns, f"w{i}", disc) for i in range(4)]
    for w in ws:
        await w.start()
    async with Router(_cfg(nats_url, ns, mode=mode), seed=3) as r:
        await wait_for(lambda: len(r.workers) == 4 and all(r.ingest.synced(w.id) for w in ws), what="sync")
        ws[0].store(SYSTEM)  # one worker already holds the system prompt
        await wait_for(lambda: r.index.num_blocks("w0") == 8, what="events")
        picks = [
            (await r.route(RouteRequest(f"b{i}", SYSTEM + [i] * 8))).worker_id for i in range(16)
        ]
        _spread(mode, picks)
    for w in ws:
        await w.close()


@pytest.mark.parametrize("mode", ["kv", "ttft"])
async def test_a_burst_over_two_replicas_spreads_as_over_one(nc, nats_url, wait_for,
                                                             mode: str) -> None:
    # The burst above, routed alternately by two replicas (as processors spread requests):
    # each route waits until the other replica has counted the one before (the shared
    # add takes a NATS hop), so neither sends the holder more than one router would.
    ns = f"t5r{mode}"
    disc = await Discovery.open(nc, ns, _cfg(nats_url, ns).discovery)
    ws = [FakeWorker(nc, ns, f"w{i}", disc) for i in range(4)]
    for w in ws:
        await w.start()
    async with Router(_cfg(nats_url, ns, mode=mode), replica=0, seed=3) as r1, \
            Router(_cfg(nats_url, ns, mode=mode), replica=1, seed=4) as r2:
        routers = (r1, r2)
        await wait_for(lambda: all(len(r.workers) == 4 and all(r.ingest.synced(w.id) for w in ws)
                                   for r in routers), what="sync")
        ws[0].store(SYSTEM)
        await wait_for(lambda: all(r.index.num_blocks("w0") == 8 for r in routers), what="events")
        picks = []
        for i in range(16):
            r, other = routers[i % 2], routers[1 - i % 2]
            picks.append((await r.route(RouteRequest(f"b{i}", SYSTEM + [i] * 8))).worker_id)
            await wait_for(lambda o=other, n=i + 1: o.load.inflight_count() == n, what="shared add")
        _spread(mode, picks)
        # both hold the whole burst in their load view, worker by worker
        for w in ws:
            assert r1.load.view(w.id) == r2.load.view(w.id)
            assert r1.load.inflight_count(w.id) == r2.load.inflight_count(w.id) == picks.count(w.id)
    for w in ws:
        await w.close()


async def test_garbage_on_the_event_subject_is_counted_and_ingest_stays_up(nc, nats_url, wait_for) -> None:
    ns = "t6"
    disc = await Discovery.open(nc, ns, _cfg(nats_url, ns).discovery)
    w = FakeWorker(nc, ns, "wz", disc)
    await w.start()
    async with Router(_cfg(nats_url, ns)) as r:
        await wait_for(lambda: r.ingest.synced("wz"), what="sync")
        await nc.publish(Subjects(ns).kv_events("wz"), b"\x00garbage")
        await nc.publish(Subjects(ns).load("wz"), b"junk")
        w.store([4] * 8)
        await wait_for(lambda: r.index.num_blocks("wz") == 2, what="events after garbage")
        assert r.metrics.bad_messages.labels("kv_events")._value.get() == 1
        await wait_for(lambda: r.metrics.bad_messages.labels("load")._value.get() == 1, what="load")
    await w.close()
    await asyncio.sleep(0)


async def test_restarted_worker_new_session_is_resynced(nc, nats_url, wait_for) -> None:
    ns = "t7"
    disc = await Discovery.open(nc, ns, _cfg(nats_url, ns).discovery)
    w = FakeWorker(nc, ns, "wr", disc)
    await w.start()
    async with Router(_cfg(nats_url, ns)) as r:
        await wait_for(lambda: r.ingest.synced("wr"), what="sync")
        w.store([1] * 8)
        w.store([2] * 8)
        await wait_for(lambda: r.index.num_blocks("wr") == 4, what="events")
        # The worker restarts: empty cache, a new publisher session, ids from 1 again.
        await w.pub.close()
        w2 = FakeWorker(nc, ns, "wr", disc)
        await w2.pub.start()
        w2.store([3] * 12)
        await wait_for(lambda: r.ingest.synced("wr") and r.index.num_blocks("wr") == 3, what="resync")
        assert r.index.find_matches(local_block_hashes([1] * 8, BS)).scores == {}
        assert r.index.find_matches(local_block_hashes([3] * 12, BS)).scores == {"wr": 3}
        await w2.pub.close()
    await w.close()


def _ignored(r: Router, reason: str, kind: str = "kv_events") -> float:
    return r.metrics.registry.get_sample_value(
        "tandem_router_events_ignored_total", {"kind": kind, "reason": reason}) or 0.0


async def test_events_and_load_of_unregistered_worker_ids_are_dropped(nc, nats_url, wait_for) -> None:
    ns = "t8"
    s = Subjects(ns)
    disc = await Discovery.open(nc, ns, _cfg(nats_url, ns).discovery)
    w = FakeWorker(nc, ns, "wreal", disc)
    await w.start()
    dump_asks: list[str] = []

    async def answer(msg) -> None:  # a forger that would even answer the dumps
        dump_asks.append(msg.subject)
        await msg.respond(encode_dump("fake0", 5, 1, [KvCleared("fake0", 1)]))

    subs = [await nc.subscribe(s.kv_dump(f"fake{i}"), cb=answer) for i in range(20)]
    async with Router(_cfg(nats_url, ns)) as r:
        await wait_for(lambda: r.ingest.synced("wreal"), what="sync")
        w.store(SYSTEM)
        await wait_for(lambda: r.index.num_blocks() == 8, what="the real worker's events")
        for i in range(20):  # 20 made-up ids, 20 blocks each
            blocks = tuple(StoredBlock(b.seq_hash, b.local_hash)
                           for b in block_hashes([i] * 80, BS))
            await nc.publish(s.kv_events(f"fake{i}"), encode_event_batch(
                f"fake{i}", 5, [KvStored(f"fake{i}", 1, None, blocks)]))
            await nc.publish(s.load(f"fake{i}"), encode_load(WorkerLoad(f"fake{i}", 1, 2, 3, 4, 5, 0.0)))
        await wait_for(lambda: _ignored(r, "unregistered") == 20
                       and _ignored(r, "unregistered", "load") == 20, what="counted")
        await asyncio.sleep(0.3)  # any dump a fake id could trigger would be asked by now
        assert r.index.num_blocks() == 8 and r.index.workers == ["wreal"]
        assert r.metrics.registry.get_sample_value("tandem_router_indexed_blocks") == 8
        assert r.ingest.buffered_blocks() == 0
        assert r.metrics.registry.get_sample_value("tandem_router_buffered_blocks") == 0
        assert not dump_asks and r.load.metrics("fake0") is None
        assert not any(r.ingest.admitted(f"fake{i}") for i in range(20))
        # A worker that leaves takes its index with it; its later events are dropped too.
        await w.close()
        await wait_for(lambda: r.index.num_blocks() == 0 and not r.ingest.admitted("wreal"),
                       what="leave")
        await nc.publish(s.kv_events("wreal"), encode_event_batch("wreal", 5, [KvCleared("wreal", 1)]))
        await wait_for(lambda: _ignored(r, "unregistered") == 21, what="dropped after leaving")
    for sub in subs:
        await sub.unsubscribe()


async def test_dump_retries_back_off_exponentially_up_to_the_cap(nc, nats_url, wait_for,
                                                                  caplog) -> None:
    ns = "t9"
    s = Subjects(ns)
    disc = await Discovery.open(nc, ns, _cfg(nats_url, ns).discovery)
    asks: list[float] = []

    async def garbage(msg) -> None:  # a registered worker whose dumps never decode
        asks.append(asyncio.get_running_loop().time())
        await msg.respond(b"not a dump")

    sub = await nc.subscribe(s.kv_dump("wbad"), cb=garbage)
    lease = await disc.register(Registration("decode", "wbad", address="wbad:1"))
    caplog.set_level(logging.INFO, logger="services.router.ingest")
    async with Router(_cfg(nats_url, ns, dump_retry_max_s=0.4)) as r:
        failed = r.metrics.dumps.labels("failed")._value.get
        # NOTE: equal only once the last answer is back: every ask counted as failed
        await wait_for(lambda: len(asks) >= 7 and failed() == len(asks), what="seven failed dumps")
        # The retry delays the router chose: 0.05, 0.1, 0.2, 0.4, then every 0.4 s. NOTE:
        # read from its own record, not from the arrival times, which a loaded machine
        # stretches; the arrivals only show each wait was honoured.
        delays = [rec.args[2] for rec in caplog.records
                  if rec.name == "services.router.ingest" and rec.msg.startswith("KV dump of")]
        want = [0.05, 0.1, 0.2, 0.4, 0.4, 0.4]
        assert delays[:6] == want and set(delays[6:]) <= {0.4}, delays
        gaps = [b - a for a, b in zip(asks, asks[1:], strict=False)]
        for got, w in zip(gaps, want, strict=False):
            assert got >= w * 0.9, gaps
        # Gone from discovery: no more asks at all.
        await lease.close()
        await wait_for(lambda: "wbad" not in r.workers, what="leave")
        n = len(asks)
        await asyncio.sleep(1.0)
        assert len(asks) == n
    await sub.unsubscribe()


async def test_a_forged_session_costs_a_dump_or_two_not_a_loop(nc, nats_url, wait_for) -> None:
    ns = "t10"
    s = Subjects(ns)
    disc = await Discovery.open(nc, ns, _cfg(nats_url, ns).discovery)
    w = FakeWorker(nc, ns, "wf", disc)
    await w.start()
    async with Router(_cfg(nats_url, ns)) as r:
        await wait_for(lambda: r.ingest.synced("wf"), what="sync")
        w.store(SYSTEM)
        await wait_for(lambda: r.index.num_blocks("wf") == 8, what="events")
        ok = r.metrics.dumps.labels("ok")._value.get()
        # One batch under the worker's id with a made-up session and a bogus block.
        await nc.publish(s.kv_events("wf"), encode_event_batch(
            "wf", 12345, [KvStored("wf", 1, None, (StoredBlock(1, 2),))]))
        await wait_for(lambda: _ignored(r, "stale_session") == 1, what="the stale batch dropped")
        await wait_for(lambda: r.ingest.synced("wf") and r.metrics.dumps.labels("ok")._value.get() - ok == 2,
                       what="the resync and the one dump after it")
        await asyncio.sleep(1.5)  # a loop would dump again every MIN_DUMP_INTERVAL_S
        assert r.metrics.dumps.labels("ok")._value.get() - ok == 2
        assert r.index.num_blocks("wf") == 8 and not r.index.holds("wf", 1)
        assert r.index.find_matches(local_block_hashes(SYSTEM, BS)).scores == {"wf": 8}
    await w.close()


async def test_a_dump_past_the_bound_is_indexed_up_to_it(nc, nats_url, wait_for) -> None:
    ns = "t11"
    disc = await Discovery.open(nc, ns, _cfg(nats_url, ns).discovery)
    w = FakeWorker(nc, ns, "wbig", disc)
    for i in range(5):
        w.store([i] * 16, publish=False)  # 4 blocks each, before any router listens
    await w.start()
    async with Router(_cfg(nats_url, ns, max_blocks_per_worker=10)) as r:
        await wait_for(lambda: r.ingest.synced("wbig"), what="dump")
        assert r.index.num_blocks("wbig") == 8  # two whole chains; the rest refused
        assert _ignored(r, "over_limit") == 3
        assert r.metrics.registry.get_sample_value("tandem_router_indexed_blocks") == 8
        r.index.check_integrity()
    await w.close()
