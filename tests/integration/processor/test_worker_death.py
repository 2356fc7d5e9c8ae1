"""kill -9 of a real `tandem decode` process mid-stream: the processor migrates the stream
to the other decode process and the client's text equals an undisturbed greedy run; later
requests still complete; with every worker dead the stream ends with a clear error."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from services.api.processor import ProcessRequest
from services.common.address_book import ChannelPool
from services.common.errors import Unavailable
from services.model.tokenizer import Tokenizer
from services.processor.processor import Processor
from services.processor.worker_client import DecodeWorkerClient
from services.router.router import Router
from tests.support.mock_cluster import MODEL, NO_MODEL, mock_cluster_cfg
from tests.support.ports import free_port_pair
from tests.support.procs import decode_procs, wait_workers
from tests.support.stack import chat

pytestmark = pytest.mark.asyncio



async def test_kill9_decode_worker_mid_stream_migrates(nats_url: str, smollm2_path: Path,
                                                       tmp_path: Path) -> None:
    tok = Tokenizer.from_path(smollm2_path)
    cfg = mock_cluster_cfg(nats_url, model={"path": NO_MODEL},
                           engine={"max_num_seqs": 8, "mock": {"step_base_s": 0.03}},
                           decode={"port": free_port_pair(), "metrics_port": free_port_pair(),
                                   "grace_period_s": 1, "disagg": {"enabled": False}})
    pool = ChannelPool()
    async with decode_procs(cfg, tmp_path) as parts, Router(cfg) as router:
        await wait_workers(router, {"decode-0", "decode-1"}, parts)
        p = Processor(tok, router, DecodeWorkerClient(pool), MODEL, 512, 16)
        ref = [d async for d in p.generate(chat("ref", max_tokens=60, temperature=0))]

        async def disturbed() -> tuple[list, str]:
            deltas, victim = [], ""
            async for d in p.generate(chat("mig", max_tokens=60, temperature=0)):
                deltas.append(d)
                if len(deltas) == 5:
                    victim = next(w for w in ("decode-0", "decode-1")
                                  if router.load.inflight_count(w) > 0)
                    next(x for x in parts if x.name == victim).kill9()
            return deltas, victim

        deltas, victim = await asyncio.wait_for(disturbed(), 30)
        assert victim
        assert "".join(d.text for d in deltas) == "".join(d.text for d in ref)
        assert deltas[-1].finish_reason == "length" and deltas[-1].usage.completion_tokens == 60
        assert p.metrics.registry.get_sample_value("tandem_processor_migrations_total") == 1
        # A request after the death completes too, whether or not the router still lists
        # the dead worker (a refused start migrates like a mid-stream death).
        after = await asyncio.wait_for(
            _collect(p, chat("after", max_tokens=10, temperature=0)), 20)
        assert after[-1].finish_reason == "length"
        # Discovery's TTL removes the dead worker from the router.
        deadline = time.monotonic() + 10
        while victim in router.workers:
            assert time.monotonic() < deadline, "the dead worker stayed in discovery"
            await asyncio.sleep(0.1)
        # With every worker dead, a stream ends with a clear error (no hang).
        survivor = next(x for x in parts if x.name != victim)

        async def all_dead() -> None:
            n = 0
            async for _ in p.generate(chat("last", max_tokens=200, temperature=0)):
                n += 1
                if n == 3:
                    survivor.kill9()

        with pytest.raises(Unavailable, match="no other decode worker can continue it"):
            await asyncio.wait_for(all_dead(), 20)
    await pool.close()


async def _collect(p: Processor, req: ProcessRequest) -> list:
    return [d async for d in p.generate(req)]
