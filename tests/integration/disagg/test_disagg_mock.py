"""Disaggregation with the mock runner (real scheduler, KV cache and KV bytes; simulated
forward time): decision paths, partial prefix hits, timeouts, cancellation, no leaks."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

import pytest

from services.api.sampling import SamplingParams
from services.disagg.prefill_outcome import PrefillLocation
from services.engine.request import GenerateRequest
from services.gen import request_pb2, worker_pb2
from tests.support.disagg_harness import (
    decode_worker,
    generate,
    metric,
    prefill_worker,
    settle,
)
from tests.support.mock_cluster import mock_cluster_cfg

pytestmark = pytest.mark.asyncio

LONG = [(i * 7 + 3) % 997 + 3 for i in range(40)]  # 40 tokens = 10 blocks of 4
SHORT = LONG[:6]


def _cfg(nats_url: str, **disagg):
    d = {"max_local_prefill_length": 16, "remote_prefill_timeout_s": 10.0, **disagg}
    return mock_cluster_cfg(nats_url, small=True, decode={"disagg": d},
                            prefill={"ack_wait_s": 2.0, "in_progress_interval_s": 0.5})


async def test_remote_equals_local_and_both_paths_are_counted(nats_url: str) -> None:
    cfg = _cfg(nats_url)
    async with decode_worker(cfg) as d, prefill_worker(cfg):
        remote = await generate(d, "r1", LONG)
        short = await generate(d, "r2", SHORT)
        assert remote.where == PrefillLocation.REMOTE and short.where == PrefillLocation.LOCAL
        assert remote.usage.prompt_tokens == 40 and remote.usage.completion_tokens == 8
        assert metric(d.worker, "tandem_worker_prefill_total", where="remote") == 1
        assert metric(d.worker, "tandem_worker_prefill_total", where="local") == 1
        assert metric(d.worker, "tandem_worker_kv_transfer_bytes_received_total") > 0
    local_cfg = _cfg(nats_url, enabled=False)
    async with decode_worker(local_cfg) as d2:
        local = await generate(d2, "r1", LONG)
        assert local.where == PrefillLocation.LOCAL
        assert metric(d2.worker, "tandem_worker_prefill_total", where="local") == 1
        assert metric(d2.worker, "tandem_worker_prefill_decisions_total", reason="disabled") == 1
    assert remote.tokens == local.tokens and len(local.tokens) == 8


async def test_a_predict_decision_reports_measured_over_predicted(nats_url: str) -> None:
    """tandem_worker_prefill_ttft_ratio: one observation per predict-policy decision, on
    the side it chose; the short prompt's decision predicts nothing."""
    # steps that take time, so that the predictions are not 0
    disagg = {"max_local_prefill_length": 16, "remote_prefill_timeout_s": 10.0, "policy": "predict",
              "prediction_correction": 0.1}
    cfg = mock_cluster_cfg(nats_url, small=True, decode={"disagg": disagg},
                           engine={"mock": {"step_base_s": 0.002, "per_prefill_token_s": 0.0001}})
    async with decode_worker(cfg) as d, prefill_worker(cfg):
        long = await generate(d, "p1", LONG)
        await generate(d, "p2", SHORT)
        assert metric(d.worker, "tandem_worker_prefill_decisions_total", reason="short") == 1
        side = long.where.value
        other = "remote" if side == "local" else "local"
        assert metric(d.worker, "tandem_worker_prefill_ttft_ratio_count", where=side) == 1
        assert metric(d.worker, "tandem_worker_prefill_ttft_ratio_sum", where=side) > 0
        assert metric(d.worker, "tandem_worker_prefill_ttft_ratio_count", where=other) == 0
        # the side's correction moved a tenth of the way (prediction_correction 0.1) to the
        # ratio measured, the other side's did not
        ratio = metric(d.worker, "tandem_worker_prefill_ttft_ratio_sum", where=side)
        remote = side == "remote"
        assert d.worker._bias[remote] == pytest.approx(0.9 + 0.1 * min(max(ratio, 0.25), 4.0))
        assert d.worker._bias[not remote] == 1.0


async def test_a_remote_decision_whose_blocks_do_not_fit_gives_its_reservation_back(
        nats_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """begin_remote_prefill finds no room: the prompt prefills here, and its tokens stop
    counting as queued remotely at once, not when its stream ends."""
    cfg = _cfg(nats_url)
    async with decode_worker(cfg) as d:
        async def no_room(request):  # type: ignore[no-untyped-def]
            return None

        monkeypatch.setattr(d.engine, "begin_remote_prefill", no_room)
        request = GenerateRequest("nb", LONG, SamplingParams(temperature=0.0, max_tokens=8))
        queued_while_streaming = []
        async with aclosing(d.worker.generate(request)) as outs:
            async for _ in outs:
                queued_while_streaming.append(d.worker.queue.queued_tokens)
        assert queued_while_streaming and not any(queued_while_streaming)
        assert metric(d.worker, "tandem_worker_remote_prefill_fallbacks_total",
                      reason="no_blocks") == 1
        await settle(d.engine, 0)


async def test_a_prompt_logprobs_request_prefills_locally_however_long(nats_url: str) -> None:
    """A prefill worker sends KV and one token, not the prompt's logprobs."""
    cfg = _cfg(nats_url)
    async with decode_worker(cfg) as d, prefill_worker(cfg):
        r = await generate(d, "lp", LONG, max_tokens=2, prompt_logprobs=0)
        assert r.where == PrefillLocation.LOCAL and len(r.tokens) == 2
        assert metric(d.worker, "tandem_worker_prefill_total", where="remote") == 0
        assert metric(d.worker, "tandem_worker_prefill_decisions_total",
                      reason="prompt_logprobs") == 1
        await settle(d.engine, 0)


async def test_partial_prefix_hit_transfers_only_missing_blocks(nats_url: str) -> None:
    cfg = _cfg(nats_url, max_local_prefill_length=8)
    async with decode_worker(cfg) as d, prefill_worker(cfg):
        warm = await generate(d, "warm", LONG[:24] + [9, 9], max_tokens=1)  # caches 6 blocks
        assert warm.where == PrefillLocation.REMOTE
        before = metric(d.worker, "tandem_worker_kv_transfer_bytes_received_total")
        r = await generate(d, "x", LONG)
        got = metric(d.worker, "tandem_worker_kv_transfer_bytes_received_total") - before
        assert r.where == PrefillLocation.REMOTE and r.usage.cached_tokens == 24
        # mock KV: (1 layer, K+V, blocks, 4 tokens, 1 head, dim 1) float32 -> 32 bytes a block
        assert got == (10 - 6) * 32
        await settle(d.engine, 0)


async def test_queue_full_goes_local(nats_url: str) -> None:
    cfg = _cfg(nats_url, max_prefill_queue_size=0)
    async with decode_worker(cfg) as d:
        r = await generate(d, "q", LONG)
        assert r.where == PrefillLocation.LOCAL
        assert metric(d.worker, "tandem_worker_prefill_decisions_total", reason="queue_full") == 1
        assert metric(d.worker, "tandem_worker_prefill_total", where="local") == 1


async def test_no_prefill_worker_times_out_to_local_and_frees_blocks(nats_url: str) -> None:
    cfg = _cfg(nats_url, remote_prefill_timeout_s=0.6)
    async with decode_worker(cfg) as d:
        r = await generate(d, "t", LONG)
        assert r.where == PrefillLocation.LOCAL and len(r.tokens) == 8
        assert metric(d.worker, "tandem_worker_remote_prefill_fallbacks_total", reason="timeout") == 1
        await settle(d.engine, 0)
        # The abandoned job was taken off the queue, so no prefill worker will run it.
        # (A job that could not be retracted is acked unworked past its deadline.)
        deadline = asyncio.get_running_loop().time() + 5
        while True:
            d.worker.queue._depth_at = float("-inf")  # noqa: SLF001 - force a fresh read
            if await d.worker.queue.depth() == 0:
                break
            assert asyncio.get_running_loop().time() < deadline, "abandoned job not retracted"
            await asyncio.sleep(0.05)
        await settle(d.engine, 0)


async def test_cancelled_call_while_waiting_for_kv_frees_blocks(nats_url: str) -> None:
    cfg = _cfg(nats_url)
    async with decode_worker(cfg) as d:  # no prefill worker: the request waits
        call = d.stub.Generate(worker_pb2.GenerateRequest(
            request_id="c", token_ids=LONG, sampling=request_pb2.SamplingParams(max_tokens=4)))
        task = asyncio.create_task(call.read())
        deadline = asyncio.get_running_loop().time() + 5
        while not d.worker.receiver.is_waiting("c"):
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.02)
        assert d.engine.stats().kv_blocks_used == 10
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await settle(d.engine, 0)
        assert not d.worker.receiver.is_waiting("c")
