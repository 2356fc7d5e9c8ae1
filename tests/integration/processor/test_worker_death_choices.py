"""kill -9 of a real `tandem decode` process (real SmolLM2 on the torch runner) mid-stream
under an n = 3 seeded request and under a JSON-schema request: the processor migrates the
stream to another decode process (each unfinished choice as its own request, a grammar
replayed over the tokens produced) and the client's text equals an undisturbed run's, in
deterministic mode (a recomputed prefix gives the same logits bits only there)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from services.api.processor import ChatMessage, Delta, ProcessRequest
from services.api.sampling import SamplingParams
from services.api.structured import StructuredOutput
from services.common.address_book import ChannelPool
from services.model.tokenizer import Tokenizer
from services.processor.processor import Processor
from services.processor.worker_client import DecodeWorkerClient
from services.router.router import Router
from tests.support.mock_cluster import MODEL, mock_cluster_cfg
from tests.support.ports import free_port_pair
from tests.support.procs import decode_procs, wait_workers

pytestmark = pytest.mark.asyncio

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "maxLength": 24}}, "required": ["name", "age", "city"]}


def _request(rid: str, **sampling: object) -> ProcessRequest:
    return ProcessRequest(rid, messages=(ChatMessage("user", "Describe a person as JSON."),),
                          model=MODEL, sampling=SamplingParams(**sampling))


def _texts(deltas: list[Delta], n: int) -> list[str]:
    return ["".join(d.text for d in deltas if d.index == i) for i in range(n)]


async def test_kill9_mid_stream_migrates_n3_and_grammar_requests(
        nats_url: str, smollm2_path: Path, tmp_path: Path) -> None:
    from services.engine.cpu_kernels import build, isa

    if not any(build.available(i) for i in isa.ISAS):
        pytest.skip("engine.deterministic needs a CPU kernel set, and none can run here")
    tok = Tokenizer.from_path(smollm2_path)
    cfg = mock_cluster_cfg(nats_url, model={"name": MODEL, "path": "auto"},
                           # NOTE: deterministic: the new worker recomputes the prefix in one
                           # prefill, whose logits are the same bits only in this mode (on the
                           # eager float32 forward they differed on an AMD EPYC, and a seeded
                           # draw followed them)
                           engine={"runner": "torch", "device": "cpu", "dtype": "bfloat16",
                                   "deterministic": True, "threads": 1, "num_kv_blocks": 256,
                                   "max_model_len": 1024, "max_num_seqs": 8},
                           decode={"port": free_port_pair(), "metrics_port": free_port_pair(),
                                   "grace_period_s": 1, "disagg": {"enabled": False}})
    spec = StructuredOutput.json_schema(SCHEMA)
    cases = [
        ("n3", 3, dict(n=3, temperature=1.0, seed=11, max_tokens=60, ignore_eos=True)),
        ("json", 1, dict(temperature=0.0, max_tokens=60, structured=spec)),
    ]
    pool = ChannelPool()
    # NOTE: three workers: each case kills one and needs another to continue on.
    async with decode_procs(cfg, tmp_path, n=3) as parts, Router(cfg) as router:
        await wait_workers(router, {"decode-0", "decode-1", "decode-2"}, parts, timeout=240)
        p = Processor(tok, router, DecodeWorkerClient(pool), MODEL, 1024, 16)
        alive = list(parts)

        async def disturbed(rid: str, sampling: dict, alive: list) -> tuple[list[Delta], str]:
            deltas: list[Delta] = []
            victim = ""
            async for d in p.generate(_request(rid, **sampling)):
                deltas.append(d)
                if len(deltas) == 3:
                    victim = next(w.name for w in alive if router.load.inflight_count(w.name) > 0)
                    next(x for x in alive if x.name == victim).kill9()
            return deltas, victim

        migrations = p.metrics.registry.get_sample_value("tandem_processor_migrations_total") or 0
        for name, n, sampling in cases:
            ref = [d async for d in p.generate(_request(f"{name}-ref", **sampling))]
            deltas, victim = await asyncio.wait_for(disturbed(f"{name}-mig", sampling, alive), 120)
            assert victim, name
            alive = [x for x in alive if x.name != victim]
            assert _texts(deltas, n) == _texts(ref, n), name
            assert deltas[-1].usage is not None and ref[-1].usage is not None
            assert deltas[-1].usage.completion_tokens == ref[-1].usage.completion_tokens
            if name == "json" and deltas[-1].finish_reason == "stop":
                assert set(json.loads(_texts(deltas, 1)[0])) == set(SCHEMA["properties"])
            # every choice moved (a start the dead worker refused counts once more)
            now = p.metrics.registry.get_sample_value("tandem_processor_migrations_total")
            assert now is not None and now - migrations >= n, name
            migrations = now
    await pool.close()
