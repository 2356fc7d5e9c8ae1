"""SIGKILL of a non-entry tensor-parallel rank mid-stream: its worker fails the forward at
once (a clear log line, not a hang), leaves discovery and exits non-zero; the processor
migrates the stream to the other worker and the client's text equals an undisturbed
greedy run."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from services.common.address_book import ChannelPool
from services.common.config import ClusterConfig
from services.processor.processor import Processor
from services.processor.worker_client import DecodeWorkerClient
from services.router.router import Router
from tests.support.mock_cluster import MODEL, cluster_cfg
from tests.support.ports import free_port_pair
from tests.support.procs import decode_procs, wait_workers
from tests.support.stack import chat

pytestmark = pytest.mark.asyncio


def _cfg(nats_url: str, model: Path) -> ClusterConfig:
    return cluster_cfg(
        nats_url,
        model={"name": MODEL, "path": str(model)},
        engine={"runner": "torch", "device": "cpu", "dtype": "float32", "block_size": 16,
                "num_kv_blocks": 128, "max_model_len": 512, "max_num_seqs": 8,
                "max_num_batched_tokens": 256, "tensor_parallel_size": 3, "tp_timeout_s": 20},
        decode={"port": free_port_pair(), "metrics_port": free_port_pair(),
                "grace_period_s": 1, "disagg": {"enabled": False}},
        discovery={"ttl_s": 2, "heartbeat_s": 0.5})


def _rank_pids(worker_pid: int) -> list[int]:
    """The worker's TP rank processes: its children started by multiprocessing's spawn."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmd = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == worker_pid and b"spawn_main" in cmd:
            pids.append(int(stat.parent.name))
    return pids


async def test_sigkill_of_a_rank_mid_stream_migrates(nats_url: str, smollm2_path: Path,
                                                     smollm2_tokenizer, tmp_path: Path) -> None:
    import os
    import signal

    cfg = _cfg(nats_url, smollm2_path)
    pool = ChannelPool()
    async with decode_procs(cfg, tmp_path) as parts, Router(cfg) as router:
        await wait_workers(router, {"decode-0", "decode-1"}, parts, timeout=240)
        p = Processor(smollm2_tokenizer, router, DecodeWorkerClient(pool), MODEL, 512, 16)
        ref = [d async for d in p.generate(chat("ref", max_tokens=40, temperature=0))]
        victim = None

        async def disturbed() -> list:
            nonlocal victim
            deltas = []
            async for d in p.generate(chat("mig", max_tokens=40, temperature=0)):
                deltas.append(d)
                if len(deltas) == 5:
                    name = next(w for w in ("decode-0", "decode-1") if router.load.inflight_count(w) > 0)
                    victim = next(x for x in parts if x.name == name)
                    ranks = _rank_pids(victim.proc.pid)
                    assert len(ranks) == 2, ranks
                    os.kill(min(ranks), signal.SIGKILL)
            return deltas

        deltas = await asyncio.wait_for(disturbed(), 120)
        assert victim is not None
        assert "".join(d.text for d in deltas) == "".join(d.text for d in ref)
        assert deltas[-1].finish_reason == "length" and deltas[-1].usage.completion_tokens == 40
        assert p.metrics.registry.get_sample_value("tandem_processor_migrations_total") == 1
        # The worker goes down by itself: out of discovery, then exits non-zero with the
        # rank named in its log.
        deadline = time.monotonic() + 30
        while victim.name in router.workers:
            assert time.monotonic() < deadline, "the worker stayed in discovery"
            await asyncio.sleep(0.1)
        code = await asyncio.to_thread(victim.wait, 30)
        assert code not in (None, 0), victim.output()
        log_text = victim.output(tail=None)
        assert "exited with code -9; this worker can no longer run its forward" in log_text
        assert "Traceback" not in log_text, victim.output()
        assert not _rank_pids(victim.proc.pid)
    await pool.close()
