"""Moving requests off a draining decode worker (docs/reliability.md "Moving requests on
scale-down"): two real decode workers on real gRPC over TCP and an in-process router; the
worker serving a stream drains mid-stream and the stream goes on on the other one, its KV
pulled (MoveKv) rather than prefilled again, with the text of an undisturbed run."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack
from pathlib import Path

import pytest

from services.api.processor import ProcessRequest
from services.common.address_book import ChannelPool
from services.common.discovery import Registration
from services.engine.timings import StepKind
from services.model.tokenizer import Tokenizer
from tests.support.mock_cluster import mock_cluster_cfg
from tests.support.stack import DecodeNode, RecordingRouter, chat, make_processor, worker_decode_node

CTX = 512


@pytest.fixture(scope="module")
def tok(smollm2_path: Path) -> Tokenizer:
    return Tokenizer.from_path(smollm2_path)


def metric(node: DecodeNode, name: str, **labels: str) -> float:
    v = node.worker.metrics.registry.get_sample_value(name, labels)
    return 0.0 if v is None else v


def prefill_steps(node: DecodeNode) -> int:
    """Steps of the node's engine that computed prompt tokens."""
    t = node.engine.engine.timings
    return t.step_seconds[StepKind.PREFILL].count + t.step_seconds[StepKind.MIXED].count


async def run_draining_after(p, req: ProcessRequest, nodes: list[DecodeNode], router,
                             after: int) -> tuple[list, DecodeNode]:
    """Consume ``req``; after ``after`` deltas the node serving it leaves the router and
    drains (as on SIGTERM: discovery first)."""
    deltas, src, drain = [], None, None
    async for d in p.generate(req):
        deltas.append(d)
        if len(deltas) == after and src is None:
            src = next(n for n in nodes if req.request_id in n.worker.generate_calls)
            router.worker_left(src.worker.worker_id)
            drain = asyncio.create_task(src.worker.drain(10))
    assert src is not None and drain is not None
    assert await drain  # idle at the end: every held request was pulled or freed
    return deltas, src


async def assert_no_leaks(*nodes: DecodeNode) -> None:
    for n in nodes:
        await n.engine.check_integrity()
        assert n.engine.stats().kv_blocks_used == 0
        assert n.worker.outbox.num_held == 0 and n.worker.receiver.num_waiting == 0


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
