"""SIGTERM of a real `tandem decode` process mid-stream (decode.drain: move, the default):
the worker leaves discovery, moves the stream's KV to the other decode process, and exits 0;
the client's text equals an undisturbed greedy run and the other worker imported the KV
(no replay)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from services.common.address_book import ChannelPool
from services.model.tokenizer import Tokenizer
from services.processor.processor import Processor
from services.processor.worker_client import DecodeWorkerClient
from services.router.router import Router
from tests.support.mock_cluster import MODEL, NO_MODEL, mock_cluster_cfg
from tests.support.ports import free_port_pair
from tests.support.procs import decode_procs, wait_workers
from tests.support.stack import chat

pytestmark = pytest.mark.asyncio


def _scrape(port: int, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


async def test_sigterm_moves_the_stream_to_the_other_process(nats_url: str, smollm2_path: Path,
                                                             tmp_path: Path) -> None:
    tok = Tokenizer.from_path(smollm2_path)
    metrics_port = free_port_pair()
    cfg = mock_cluster_cfg(nats_url, model={"path": NO_MODEL},
                           engine={"max_num_seqs": 8, "mock": {"step_base_s": 0.03}},
                           decode={"port": free_port_pair(), "metrics_port": metrics_port,
                                   "grace_period_s": 10, "disagg": {"enabled": False}})
    pool = ChannelPool()
    async with decode_procs(cfg, tmp_path) as parts, Router(cfg) as router:
        await wait_workers(router, {"decode-0", "decode-1"}, parts)
        p = Processor(tok, router, DecodeWorkerClient(pool), MODEL, 512, 16)
        ref = [d async for d in p.generate(chat("ref", max_tokens=60, temperature=0))]

        async def drained() -> tuple[list, int]:
            deltas, victim = [], -1
            async for d in p.generate(chat("mv", max_tokens=60, temperature=0)):
                deltas.append(d)
                if len(deltas) == 5:
                    victim = next(i for i, w in enumerate(("decode-0", "decode-1"))
                                  if router.load.inflight_count(w) > 0)
                    parts[victim].terminate()
            return deltas, victim

        deltas, victim = await asyncio.wait_for(drained(), 60)
        assert victim >= 0
        assert "".join(d.text for d in deltas) == "".join(d.text for d in ref)
        assert deltas[-1].finish_reason == "length" and deltas[-1].usage.completion_tokens == 60
        reg = p.metrics.registry
        assert reg.get_sample_value("tandem_processor_moves_total", {"kind": "kv"}) == 1
        assert reg.get_sample_value("tandem_processor_migrations_total") == 0
        target = 1 - victim
        assert _scrape(metrics_port + target, "tandem_worker_moves_received_total",
                       outcome="imported") == 1
        assert await asyncio.to_thread(parts[victim].wait, 20) == 0
        assert parts[target].alive()
    await pool.close()
