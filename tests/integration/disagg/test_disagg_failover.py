"""A prefill worker process SIGKILLed mid-job: JetStream redelivers the job to another
prefill worker, the request completes within its deadline with the same tokens as a local
prefill, and the decode worker's used blocks return to their baseline."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from services.common.config import parse_config
from services.common.nats_client import Subjects, connect
from services.disagg.prefill_outcome import PrefillLocation
from tests.support.disagg_harness import (
    decode_worker,
    generate,
    metric,
    prefill_worker,
    settle,
)
from tests.support.mock_cluster import merged, mock_cluster_cfg
from tests.support.procs import start_part, write_config

pytestmark = pytest.mark.asyncio

PROMPT = [(i * 13 + 5) % 991 + 3 for i in range(48)]


async def test_killed_prefill_worker_job_is_redelivered_and_completes(
        nats_url: str, tmp_path: Path) -> None:
    # The subprocess' engine is slow (simulated 0.2 s per prompt token): it is mid-job
    # for ~10 s when it is killed. The in-process replacement is instant.
    cfg = mock_cluster_cfg(nats_url, small=True,
                           decode={"disagg": {"max_local_prefill_length": 16,
                                              "remote_prefill_timeout_s": 30.0}},
                           prefill={"ack_wait_s": 1.0, "in_progress_interval_s": 0.3,
                                    "metrics_port": 0})
    slow = merged(cfg.model_dump(mode="json"), {"engine": {"mock": {"per_prefill_token_s": 0.2}}})
    cfg_file = write_config(parse_config(slow), tmp_path / "cluster.yaml")
    proc = start_part("prefill", cfg_file, tmp_path)
    subjects = Subjects(cfg.namespace)
    nc = await connect(cfg.nats, "observer")
    js = nc.jetstream()
    try:
        async with decode_worker(cfg) as d:
            baseline = d.engine.stats().kv_blocks_used
            call = asyncio.create_task(generate(d, "k", PROMPT, max_tokens=6))
            # Mid-job: the subprocess has taken the job (unacked, nothing pending).
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 60
            while True:
                proc.assert_alive()
                assert loop.time() < deadline, "the prefill subprocess never took the job"
                try:
                    info = await js.consumer_info(subjects.prefill_stream, subjects.prefill_consumer)
                    if info.num_ack_pending == 1 and info.num_pending == 0:
                        break
                except Exception:  # noqa: BLE001 - the subprocess may not have created it yet
                    pass
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)  # a few in-progress acks have gone out
            proc.kill9()
            assert not call.done()
            async with prefill_worker(cfg, "prefill-new") as p:
                r = await asyncio.wait_for(call, 20)
                assert p.metrics.registry.get_sample_value(
                    "tandem_prefill_jobs_total", {"outcome": "delivered"}) == 1
            assert r.where == PrefillLocation.REMOTE and len(r.tokens) == 6
            assert metric(d.worker, "tandem_worker_prefill_total", where="remote") == 1
            await settle(d.engine, baseline)
        cfg_local = cfg.model_copy(update={"decode": cfg.decode.model_copy(
            update={"disagg": cfg.decode.disagg.model_copy(update={"enabled": False})})})
        async with decode_worker(cfg_local, "decode-local") as d2:
            local = await generate(d2, "k", PROMPT, max_tokens=6)
        assert r.tokens == local.tokens
    finally:
        proc.kill9()
        await nc.close()


def _slow(cfg, **prefill):
    """``cfg`` with a prefill engine that takes ~3.8 s for PROMPT (0.08 s per prompt token)."""
    return cfg.model_copy(update={
        "engine": cfg.engine.model_copy(update={
            "mock": cfg.engine.mock.model_copy(update={"per_prefill_token_s": 0.08})}),
        "prefill": cfg.prefill.model_copy(update=prefill)})


async def _local_tokens(cfg) -> list[int]:
    cfg_local = cfg.model_copy(update={"decode": cfg.decode.model_copy(
        update={"disagg": cfg.decode.disagg.model_copy(update={"enabled": False})})})
    async with decode_worker(cfg_local, "decode-local") as d2:
        return (await generate(d2, "slow", PROMPT, max_tokens=6)).tokens


async def test_a_long_remote_prefill_that_reports_progress_is_waited_for(nats_url: str) -> None:
    """No wall-clock cliff: the decode worker gives up only on silence (1 s here), so a
    prefill that takes ~3.8 s but reports every 0.2 s runs once, remotely."""
    cfg = mock_cluster_cfg(nats_url, small=True,
                           decode={"disagg": {"max_local_prefill_length": 16,
                                              "remote_prefill_timeout_s": 1.0}},
                           prefill={"metrics_port": 0, "in_progress_interval_s": 0.2})
    async with prefill_worker(_slow(cfg), "prefill-slow") as p, decode_worker(cfg) as d:
        r = await asyncio.wait_for(generate(d, "slow", PROMPT, max_tokens=6), 20)
        assert r.where == PrefillLocation.REMOTE and len(r.tokens) == 6
        assert metric(d.worker, "tandem_worker_remote_prefill_fallbacks_total", reason="timeout") == 0
        assert p.metrics.registry.get_sample_value(
            "tandem_prefill_jobs_total", {"outcome": "delivered"}) == 1
        assert d.engine.stats().prompt_tokens_total == len(PROMPT)  # prefilled once, not twice
    assert r.tokens == await _local_tokens(cfg)


async def test_a_silent_prefill_falls_back_and_its_job_is_withdrawn(nats_url: str) -> None:
    """A prefill worker that took the job and then goes silent: the decode worker prefills
    locally after 1 s of silence and withdraws the job, which the prefill worker drops
    (no KV is sent, and no other worker retries it)."""
    cfg = mock_cluster_cfg(nats_url, small=True,
                           decode={"disagg": {"max_local_prefill_length": 16,
                                              "remote_prefill_timeout_s": 1.0}},
                           prefill={"metrics_port": 0, "in_progress_interval_s": 0.2})
    # NOTE: it reports once, when it takes the job, then not for 30 s.
    silent = _slow(cfg.model_copy(update={"decode": cfg.decode.model_copy(update={
        "disagg": cfg.decode.disagg.model_copy(update={"remote_prefill_timeout_s": 60.0})})}),
        in_progress_interval_s=30.0)
    async with prefill_worker(silent, "prefill-silent") as p, decode_worker(cfg) as d:
        baseline = d.engine.stats().kv_blocks_used
        p_baseline = p.engine.stats().kv_blocks_used
        r = await asyncio.wait_for(generate(d, "slow", PROMPT, max_tokens=6), 20)
        assert r.where == PrefillLocation.LOCAL and len(r.tokens) == 6
        assert metric(d.worker, "tandem_worker_remote_prefill_fallbacks_total", reason="timeout") == 1
        await settle(d.engine, baseline)
        # The prefill worker drops the withdrawn job: no KV is sent, nothing is retried.
        jobs = p.metrics.registry.get_sample_value
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 20  # a bound against hanging, not a measurement
        while jobs("tandem_prefill_jobs_total", {"outcome": "withdrawn"}) != 1:
            assert loop.time() < deadline, "the prefill worker never dropped the withdrawn job"
            await asyncio.sleep(0.02)
        await settle(p.engine, p_baseline, timeout=20)
        assert jobs("tandem_prefill_jobs_total", {"outcome": "delivered"}) in (None, 0.0)
        assert metric(d.worker, "tandem_worker_kv_transfer_bytes_received_total") == 0
    assert r.tokens == await _local_tokens(cfg)
