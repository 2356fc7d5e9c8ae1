"""kill -9 of a real `tandem decode` process mid-stream: the processor migrates the stream
to the other decode process and the client's text equals an undisturbed greedy run; later
requests still complete; with every worker dead the stream ends with a clear error."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from services.common.address_book import ChannelPool
from services.common.config import ClusterConfig, parse_config
from services.common.errors import Unavailable
from services.engine.request import SamplingParams
from services.engine.tokenizer import Tokenizer
from services.processor.processor import Processor
from services.processor.types import ChatMessage, ProcessRequest
from services.processor.worker_client import DecodeWorkerClient
from services.router.router import Router
from tests.support.ports import free_port_pair
from tests.support.procs import Part, start_part, write_config
from tests.support.stack import MODEL

pytestmark = pytest.mark.asyncio



def decode_cluster_cfg(nats_url: str, step_s: float = 0.03) -> ClusterConfig:
    return parse_config({
        "namespace": f"t{uuid.uuid4().hex[:10]}",
        "nats": {"url": nats_url, "embedded": False},
        "model": {"name": MODEL, "path": "/nonexistent/tandem-test-model.gguf"},
        "engine": {"runner": "mock", "block_size": 16, "num_kv_blocks": 256, "max_model_len": 512,
                   "max_num_seqs": 8, "max_num_batched_tokens": 512,
                   "mock": {"step_base_s": step_s, "per_prefill_token_s": 0, "per_decode_seq_s": 0,
                            "vocab_size": 49152, "eos_token_id": 2}},
        "decode": {"port": free_port_pair(), "metrics_port": free_port_pair(),
                   "grace_period_s": 1, "disagg": {"enabled": False}},
        "discovery": {"ttl_s": 2, "heartbeat_s": 0.5},
    })


@asynccontextmanager
async def decode_procs(cfg: ClusterConfig, tmp_path: Path, n: int = 2) -> AsyncIterator[list[Part]]:
    cfg_file = write_config(cfg, tmp_path / "cluster.yaml")
    parts = [start_part("decode", cfg_file, tmp_path, replica=i) for i in range(n)]
    try:
        yield parts
    finally:
        for p in parts:
            p.kill9()


async def wait_workers(router: Router, ids: set[str], parts: list[Part], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not ids <= set(router.workers):
        for p in parts:
            assert p.alive() or p.name not in ids, f"{p.name} died: {p.output()}"
        assert time.monotonic() < deadline, f"workers never registered: {set(router.workers)}"
        await asyncio.sleep(0.1)


def chat(rid: str, **sampling) -> ProcessRequest:
    return ProcessRequest(rid, messages=(ChatMessage("user", "Tell me a story"),), model=MODEL,
                          sampling=SamplingParams(**sampling))


async def test_kill9_decode_worker_mid_stream_migrates(nats_url: str, smollm2_path: Path,
                                                       tmp_path: Path) -> None:
    tok = Tokenizer.from_path(smollm2_path)
    cfg = decode_cluster_cfg(nats_url)
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
