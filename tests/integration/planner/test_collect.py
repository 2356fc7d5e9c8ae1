"""The planner's live signals against a real nats-server with JetStream: discovery's
workers, a decode worker's load sample, real prefill jobs in the real queue stream (their
tokens estimated from the stream's bytes, the oldest one's age from its timestamp), and
the last interval's TTFT/ITL p90, arrivals and lengths from the parts' own metrics classes
served over HTTP and differenced between two rounds."""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry, start_http_server

from services.api.wire import WorkerLoad
from services.common.config import DiscoveryConfig, NatsConfig, PrefillConfig
from services.common.discovery import Discovery, Registration
from services.common.load_publisher import publish_load
from services.common.nats_client import Subjects, connect
from services.disagg.prefill_queue import ensure_prefill_queue
from services.engine.engine import EngineStats
from services.engine.stats_metrics import EngineStatsCollector
from services.engine.timings import EngineTimings, StepKind
from services.frontend.metrics import FrontendMetrics
from services.gen import prefill_pb2
from services.planner.collect import LiveCollector
from services.planner.signals import Role
from services.processor.metrics import ProcessorMetrics
from tests.support.ports import free_port
from tests.support.waits import eventually

PROMPTS = (3000, 1500, 500)  # tokens of the three queued jobs


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _serve(registry: CollectorRegistry) -> str:
    port = free_port()
    start_http_server(port, addr="127.0.0.1", registry=registry)
    return f"127.0.0.1:{port}"


async def test_one_round_reads_every_signal(nats_url: str) -> None:
    ns = f"pl{uuid.uuid4().hex[:8]}"
    subjects = Subjects(ns)
    nc = await connect(NatsConfig(url=nats_url), "planner-test")
    disc = await Discovery.open(nc, ns, DiscoveryConfig())
    front, proc = FrontendMetrics(), ProcessorMetrics()
    stats = EngineStats(num_running=1, num_waiting=2, num_parked=0, kv_blocks_used=30, kv_blocks_cached=0,
                        kv_blocks_free=70, kv_blocks_total=100, prompt_tokens_total=0,
                        prefix_cache_hit_tokens_total=0, num_preemptions_total=0,
                        timings=EngineTimings(), num_prefill_tokens_pending=700)
    prefill_reg = CollectorRegistry()
    prefill_reg.register(EngineStatsCollector(lambda: stats))
    front_at = _serve(front.registry)
    leases = [await disc.register(r) for r in (
        Registration("decode", "decode-0", address="127.0.0.1:1"),
        Registration("decode", "decode-1", address="127.0.0.1:2"),
        Registration("prefill", "prefill-0", metrics_address=_serve(prefill_reg)),
        Registration("frontend", "frontend-0", address=front_at, metrics_address=front_at),
        Registration("processor", "processor-0", address="127.0.0.1:3",
                     metrics_address=_serve(proc.registry)),
    )]
    js = nc.jetstream()
    await ensure_prefill_queue(js, subjects, PrefillConfig())
    for i, n in enumerate(PROMPTS):
        job = prefill_pb2.RemotePrefillRequest(
            # ids like English text's under SmolLM2's vocabulary (mostly 2-byte varints)
            request_id=f"req-{i}", token_ids=[128 + (7919 * k) % 16000 for k in range(n)],
            decode_worker_id="decode-0", kv_transfer_address="127.0.0.1:1", num_blocks=n // 16,
            deadline_unix_ms=int(time.time() * 1000) + 60_000, attempt=1, transfer_token=os.urandom(16))
        await js.publish(subjects.prefill_queue, job.SerializeToString())
    published = time.time()

    clock = Clock(published + 5.0)
    collector = LiveCollector(nc, ns, disc, clock=clock)
    await collector.start()
    try:
        load = WorkerLoad("decode-0", 40, 200, 3, 1, 256, time.time(), 90, 1)
        await publish_load(nc, subjects, load)
        await eventually(lambda: "decode-0" in collector._loads, what="the load sample")

        first = await collector.collect()
        assert [(w.worker_id, w.role) for w in first.workers] == [
            ("decode-0", Role.DECODE), ("decode-1", Role.DECODE), ("prefill-0", Role.PREFILL)]
        d0, d1, p0 = first.workers
        assert (d0.kv_blocks_used, d0.kv_blocks_total, d0.requests_running, d0.requests_waiting,
                d0.pending_prefill_tokens, d0.decode_tokens_left, d0.running_unbounded) == (
                    40, 200, 3, 1, 256, 90, 1)
        assert (d1.kv_blocks_total, d1.requests_running) == (0, 0)  # no sample yet
        assert (p0.kv_blocks_used, p0.requests_waiting, p0.pending_prefill_tokens) == (30, 2, 700)
        assert first.prefill_queue_jobs == 3
        assert first.prefill_queue_tokens == pytest.approx(sum(PROMPTS), rel=0.1)
        assert first.prefill_queue_oldest_wait_s == pytest.approx(5.0, abs=1.0)
        assert first.last.arrivals == 0 and first.last.ttft_p90_s is None  # no baseline yet

        # one interval of traffic
        for v in [0.05] * 9 + [3.0]:
            front.ttft.observe(v)
        for v in [0.01] * 18 + [0.3] * 2:
            front.itl.observe(v)
        proc.requests.labels("stop").inc(8)
        proc.requests.labels("length").inc(2)
        proc.inflight.set(2)
        proc.prompt_tokens.inc(1200)
        proc.completion_tokens.inc(500)
        stats = replace(stats, prompt_tokens_total=5000, prefix_cache_hit_tokens_total=1000)
        stats.timings.step_seconds[StepKind.PREFILL].observe(2.0)
        clock.t += 10.0
        second = await collector.collect()
        last = second.last
        assert last.duration_s == 10.0
        assert last.arrivals == 12 and last.arrival_rate == pytest.approx(1.2)
        assert last.mean_input_tokens == pytest.approx(100.0)
        assert last.mean_output_tokens == pytest.approx(50.0)
        assert 0.04 <= last.ttft_p90_s <= 0.08  # the 9th of 10 is in the 0.04-0.08 bucket
        assert 0.01 <= last.itl_p90_s <= 0.02
        assert last.prefill_tokens_done == 4000 and last.prefill_busy_s == pytest.approx(2.0)

        await leases[1].close()  # decode-1 leaves discovery
        third = await collector.collect()
        assert [w.worker_id for w in third.workers] == ["decode-0", "prefill-0"]
        assert third.last.arrivals == 0 and third.last.ttft_p90_s is None
    finally:
        await collector.close()
        for lease in leases:
            await lease.close()
        await nc.close()
