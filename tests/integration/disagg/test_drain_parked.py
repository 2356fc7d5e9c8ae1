"""A draining decode worker (decode.drain: move) hands back a request parked for a remote
prefill that no prefill worker took: its stream ends at once with an empty ``moved`` (the
processor routes it again from scratch), not at remote_prefill_timeout_s; its job leaves
the queue and its blocks are freed."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.api.sampling import SamplingParams
from services.api.worker_codec import generate_request_to_pb
from tests.support.disagg_harness import decode_worker, metric
from tests.support.mock_cluster import mock_cluster_cfg

pytestmark = pytest.mark.asyncio


async def test_a_parked_remote_prefill_is_handed_back_at_once(nats_url: str) -> None:
    cfg = mock_cluster_cfg(nats_url, small=True,
                           decode={"disagg": {"max_local_prefill_length": 8,
                                              "remote_prefill_timeout_s": 60}})
    async with decode_worker(cfg) as d:  # no prefill worker: the job waits in the queue
        sp = SamplingParams(max_tokens=8, temperature=0)
        call = d.stub.Generate(generate_request_to_pb("p", list(range(10, 50)), sp))
        while d.engine.stats().num_parked < 1:
            await asyncio.sleep(0.01)
        t0 = time.monotonic()
        drain = asyncio.create_task(d.worker.drain(10))
        msgs = [m async for m in call]
        assert time.monotonic() - t0 < 5
        assert len(msgs) == 1 and msgs[0].HasField("moved") and not msgs[0].moved.address
        assert await drain
        assert metric(d.worker, "tandem_worker_requests_moved_total", outcome="handed_back") == 1
        deadline = time.monotonic() + 5
        while await d.worker.queue.depth() != 0:  # the job is retracted
            assert time.monotonic() < deadline, "the handed-back request's job stayed queued"
            await asyncio.sleep(0.05)
        await d.engine.check_integrity()
        assert d.engine.stats().kv_blocks_used == 0
