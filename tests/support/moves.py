"""Helpers of the tests that move requests off a draining decode worker
(docs/reliability.md "Moving requests on scale-down")."""

from __future__ import annotations

import asyncio

from services.api.processor import Delta, ProcessRequest
from services.engine.timings import StepKind
from services.processor.processor import Processor
from services.router.router import Router
from tests.support.stack import DecodeNode


def metric(node: DecodeNode, name: str, **labels: str) -> float:
    v = node.worker.metrics.registry.get_sample_value(name, labels)
    return 0.0 if v is None else v


def prefill_steps(node: DecodeNode) -> int:
    """Steps of the node's engine that computed prompt tokens."""
    t = node.engine.engine.timings
    return t.step_seconds[StepKind.PREFILL].count + t.step_seconds[StepKind.MIXED].count


async def run_draining_after(p: Processor, req: ProcessRequest, nodes: list[DecodeNode], router: Router,
                             after: int) -> tuple[list[Delta], DecodeNode]:
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
