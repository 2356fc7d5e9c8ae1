"""Disaggregation across tensor-parallel sizes: a prefill worker at TP=1 sends a prompt's KV
to a decode worker at TP=3 (SmolLM2: 3 KV heads, one per decode rank); the greedy tokens
equal a local prefill's. The KV on the wire has the whole model's layout; the decode entry
rank scatters each rank its KV head."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.api.sampling import SamplingParams
from services.disagg.prefill_outcome import PrefillLocation
from services.engine.request import GenerateRequest
from services.engine.tp.runner import TpRunner
from services.prefill.worker import PrefillWorker
from tests.support.disagg_harness import (
    DecodeHandle,
    decode_worker,
    generate,
    prefill_worker,
    settle,
)
from tests.support.mock_cluster import cluster_cfg

pytestmark = pytest.mark.asyncio


def _engine(**kw):
    return {"runner": "torch", "device": "cpu", "dtype": "float32", "block_size": 16,
            "num_kv_blocks": 64, "max_num_seqs": 4, "max_num_batched_tokens": 256,
            "max_model_len": 1024, "tp_timeout_s": 120, **kw}


async def test_prefill_tp1_to_decode_tp3_equals_local(nats_url: str, smollm2_path: Path) -> None:
    common = dict(model={"path": str(smollm2_path)}, decode={"disagg": {"max_local_prefill_length": 48}})
    decode_cfg = cluster_cfg(nats_url, engine=_engine(tensor_parallel_size=3), **common)
    prefill_cfg = decode_cfg.model_copy(update={"engine": decode_cfg.engine.model_copy(
        update={"tensor_parallel_size": 1})})
    long = [(i * 7919 + 17) % 49000 + 100 for i in range(100)]
    short = long[:30]
    async with decode_worker(decode_cfg) as d:
        runner = d.engine.engine.runner
        assert isinstance(runner, TpRunner)
        try:
            async with prefill_worker(prefill_cfg) as p:
                await _compare(d, p, long, short)
        finally:
            # the rank processes, and this process's TP group, even when the prefill
            # worker never started (left running, they abort the test process at exit)
            runner.close()


async def _compare(d: DecodeHandle, p: PrefillWorker, long: list[int], short: list[int]) -> None:
    r_long = await generate(d, "long", long, max_tokens=8, ignore_eos=True)
    r_short = await generate(d, "short", short, max_tokens=8, ignore_eos=True)
    assert r_long.where == PrefillLocation.REMOTE and r_short.where == PrefillLocation.LOCAL
    await settle(d.engine, 0)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    async def local(rid: str, prompt: list[int]) -> list[int]:
        toks: list[int] = []
        async for o in p.engine.generate(GenerateRequest(rid, prompt, greedy)):
            toks += o.token_ids
        return toks

    assert r_long.tokens == await local("ref-long", long)
    assert r_short.tokens == await local("ref-short", short)
