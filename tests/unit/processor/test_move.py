"""Moving requests off a draining decode worker (docs/reliability.md "Moving requests on
scale-down"): two real decode workers on real gRPC over TCP and an in-process router; the
worker serving a stream drains mid-stream and the stream goes on on the other one, its KV
pulled (MoveKv) rather than prefilled again, with the text of an undisturbed run."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack
from pathlib import Path

import pytest

from services.common.address_book import ChannelPool
from services.common.discovery import Registration
from services.decode.move_out import MoveNotHeld
from services.model.tokenizer import Tokenizer
from tests.support.mock_cluster import mock_cluster_cfg
from tests.support.moves import assert_no_leaks, metric, prefill_steps, run_draining_after
from tests.support.stack import RecordingRouter, chat, make_processor, worker_decode_node

CTX = 512


@pytest.fixture(scope="module")
def tok(smollm2_path: Path) -> Tokenizer:
    return Tokenizer.from_path(smollm2_path)


async def test_a_drained_worker_moves_its_stream_with_its_kv(tok: Tokenizer) -> None:
    cfg = mock_cluster_cfg(engine={"mock": {"step_base_s": 0.01}})
    router = RecordingRouter(cfg)
    pool = ChannelPool()
    async with AsyncExitStack() as stack:
        nodes = [await stack.enter_async_context(worker_decode_node(cfg, tok, f"w{i}"))
                 for i in range(2)]
        for i, n in enumerate(nodes):
            router.worker_joined(Registration("decode", f"w{i}", address=n.address))
        p = make_processor(cfg, tok, router, CTX, pool)
        ref = [d async for d in p.generate(chat("ref", max_tokens=40, temperature=0))]
        # the reference ran on one of them: measure the target's prefill steps from here
        before = {n.worker.worker_id: prefill_steps(n) for n in nodes}
        deltas, src = await asyncio.wait_for(
            run_draining_after(p, chat("mv", max_tokens=40, temperature=0), nodes, router, 5), 30)
        dst = next(n for n in nodes if n is not src)
        assert "mv" in dst.worker.generate_calls  # the stream really moved
        assert "".join(d.text for d in deltas) == "".join(d.text for d in ref)
        assert deltas[-1].finish_reason == "length" and deltas[-1].usage.completion_tokens == 40
        assert metric(src, "tandem_worker_requests_moved_total", outcome="pulled") == 1
        assert metric(dst, "tandem_worker_moves_received_total", outcome="imported") == 1
        assert metric(dst, "tandem_worker_moves_received_total", outcome="replayed") == 0
        assert prefill_steps(dst) == before[dst.worker.worker_id]  # nothing prefilled again
        reg = p.metrics.registry
        assert reg.get_sample_value("tandem_processor_moves_total", {"kind": "kv"}) == 1
        assert reg.get_sample_value("tandem_processor_migrations_total") == 0
        assert reg.get_sample_value("tandem_processor_move_gap_seconds_count") == 1
        # The router carries nothing for either worker once the stream ended.
        for w in ("w0", "w1"):
            assert router.load.inflight_count(w) == 0
        await assert_no_leaks(*nodes)
    await pool.close()


async def test_a_move_whose_kv_cannot_be_pulled_falls_back_to_replay(
        tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The source's MoveKv answers NOT_FOUND (as for a request it no longer holds): the
    target prefills prompt + produced tokens instead (the replay), with the same text; the
    source frees the held KV at decode.move_timeout_s; nothing is left held on either side."""
    cfg = mock_cluster_cfg(engine={"mock": {"step_base_s": 0.01}},
                           decode={"move_timeout_s": 0.3})
    router = RecordingRouter(cfg)
    pool = ChannelPool()
    async with AsyncExitStack() as stack:
        nodes = [await stack.enter_async_context(worker_decode_node(cfg, tok, f"w{i}"))
                 for i in range(2)]
        for i, n in enumerate(nodes):
            router.worker_joined(Registration("decode", f"w{i}", address=n.address))
        p = make_processor(cfg, tok, router, CTX, pool)
        ref = [d async for d in p.generate(chat("ref", max_tokens=30, temperature=0))]

        async def gone(req):
            raise MoveNotHeld(f"no request {req.request_id!r} held")
            yield b""  # an async generator, as MoveOutbox.pull

        for n in nodes:
            monkeypatch.setattr(n.worker.outbox, "pull", gone)
        deltas, src = await asyncio.wait_for(
            run_draining_after(p, chat("mv", max_tokens=30, temperature=0), nodes, router, 4), 30)
        dst = next(n for n in nodes if n is not src)
        assert "".join(d.text for d in deltas) == "".join(d.text for d in ref)
        assert deltas[-1].usage.completion_tokens == 30
        assert metric(src, "tandem_worker_requests_moved_total", outcome="expired") == 1
        assert metric(dst, "tandem_worker_moves_received_total", outcome="replayed") == 1
        assert metric(dst, "tandem_worker_moves_received_total", outcome="imported") == 0
        for w in ("w0", "w1"):
            assert router.load.inflight_count(w) == 0
        await assert_no_leaks(*nodes)
    await pool.close()


async def test_waiting_requests_are_handed_back_and_running_ones_moved(tok: Tokenizer) -> None:
    """One seat: the second request waits on the draining worker; it is handed back (the
    processor routes it again from scratch) while the running one moves with its KV."""
    cfg = mock_cluster_cfg(engine={"max_num_seqs": 1, "mock": {"step_base_s": 0.01}})
    router = RecordingRouter(cfg)
    pool = ChannelPool()
    async with AsyncExitStack() as stack:
        src = await stack.enter_async_context(worker_decode_node(cfg, tok, "w0"))
        router.worker_joined(Registration("decode", "w0", address=src.address))
        p = make_processor(cfg, tok, router, CTX, pool)
        ref = "".join([d.text async for d in p.generate(chat("ref", max_tokens=30, temperature=0))])

        async def text(rid: str) -> str:
            return "".join([d.text async for d in p.generate(chat(rid, max_tokens=30, temperature=0))])

        running = asyncio.create_task(text("a"))
        waiting = asyncio.create_task(text("b"))
        while src.engine.stats().num_waiting < 1 or src.engine.stats().num_running < 1:
            await asyncio.sleep(0.005)
        dst = await stack.enter_async_context(worker_decode_node(cfg, tok, "w1"))
        router.worker_joined(Registration("decode", "w1", address=dst.address))
        router.worker_left("w0")
        assert await asyncio.wait_for(src.worker.drain(10), 20)
        assert await asyncio.wait_for(running, 20) == ref
        assert await asyncio.wait_for(waiting, 20) == ref
        assert metric(src, "tandem_worker_requests_moved_total", outcome="pulled") == 1
        assert metric(src, "tandem_worker_requests_moved_total", outcome="handed_back") == 1
        assert metric(dst, "tandem_worker_moves_received_total", outcome="imported") == 1
        reg = p.metrics.registry
        assert reg.get_sample_value("tandem_processor_moves_total", {"kind": "kv"}) == 1
        assert reg.get_sample_value("tandem_processor_moves_total", {"kind": "replay"}) == 1
        await assert_no_leaks(src, dst)
    await pool.close()
