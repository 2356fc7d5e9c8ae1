"""Migration of n > 1 and grammar-constrained requests: two real decode workers on real
gRPC servers, an in-process Router; the serving worker's server is stopped mid-stream and
every choice's text must equal an undisturbed run's; a draining worker hands n > 1 back
and it replays the same way. n > 1 choices continue one by one as
their own requests (``<id>.<choice>``) with their own seeds; a grammar's matcher replays
the tokens produced before. Tiny random llama for n > 1, the real SmolLM2 under a JSON
schema for grammars."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import replace
from pathlib import Path

import pytest

from services.api.processor import ChatMessage, Delta, ProcessRequest
from services.api.route import RouteRequest, RouteResponse
from services.api.sampling import SamplingParams
from services.api.structured import StructuredOutput
from services.common.address_book import ChannelPool
from services.common.config import EngineConfig
from services.common.discovery import Registration
from services.engine.engine import LLMEngine
from services.engine.grammar.compiler import GrammarCompiler
from services.engine.runner.torch_runner import TorchRunner
from services.model.tokenizer import Tokenizer
from services.processor.processor import Processor
from tests.support.mock_cluster import MODEL, mock_cluster_cfg
from tests.support.moves import assert_no_leaks, metric, run_draining_after
from tests.support.stack import DecodeNode, RecordingRouter, make_processor, worker_decode_node

CTX = 512
BS = 16
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "maxLength": 24}}, "required": ["name", "age", "city"]}


@pytest.fixture(scope="module")
def tok(smollm2_path: Path) -> Tokenizer:
    return Tokenizer.from_path(smollm2_path)


@pytest.fixture(scope="module")
def smollm2(smollm2_path: Path):
    from services.engine.weights import load_weights

    return load_weights(smollm2_path)


def _slow(runner_cls: type[TorchRunner]) -> type[TorchRunner]:
    class Slow(runner_cls):  # type: ignore[misc, valid-type]
        """Steps of at least 20 ms: the stream still runs when the test stops its worker."""

        def execute(self, batch):
            time.sleep(0.02)
            return super().execute(batch)

    return Slow


def tiny_engine(worker_id: str, seed: int) -> LLMEngine:
    from tests.support.tiny_model import tiny_hf_model

    hf, arch = tiny_hf_model("llama")
    cfg = EngineConfig(device="cpu", dtype="float32", block_size=BS, num_kv_blocks=64,
                       seed=seed, overlap=False)
    return LLMEngine(_slow(TorchRunner)(arch, hf.state_dict(), cfg), cfg, [], worker_id)


def smollm2_engine(loaded, tok: Tokenizer, worker_id: str, seed: int) -> LLMEngine:
    cfg = EngineConfig(device="cpu", dtype="float32", block_size=BS, num_kv_blocks=128,
                       max_num_seqs=8, max_num_batched_tokens=256, max_model_len=CTX,
                       seed=seed, overlap=False)
    runner = _slow(TorchRunner)(loaded.arch, loaded.tensors, cfg, CTX)
    grammar = GrammarCompiler(tok.to_json(), runner.vocab_size, tok.stop_token_ids)
    return LLMEngine(runner, cfg, tok.stop_token_ids, worker_id, grammar=grammar)


@asynccontextmanager
async def two_workers(tok: Tokenizer, engine: Callable[[str, int], LLMEngine]
                      ) -> AsyncIterator[tuple[Processor, list[DecodeNode], RecordingRouter]]:
    cfg = mock_cluster_cfg(engine={"block_size": BS})
    router = RecordingRouter(cfg)
    pool = ChannelPool()
    async with AsyncExitStack() as stack:
        nodes = []
        for i in range(2):
            nodes.append(await stack.enter_async_context(
                worker_decode_node(cfg, tok, f"w{i}", engine=engine(f"w{i}", 100 + i))))
            router.worker_joined(Registration("decode", f"w{i}", address=nodes[i].address))
        yield make_processor(cfg, tok, router, CTX, pool), nodes, router
    await pool.close()


async def run_killing_after(p: Processor, req: ProcessRequest, nodes: list[DecodeNode],
                            after: int) -> tuple[list[Delta], DecodeNode | None]:
    """Consume ``req``; after ``after`` deltas stop the gRPC server of the node serving it."""
    deltas: list[Delta] = []
    killed = None
    async for d in p.generate(req):
        deltas.append(d)
        if len(deltas) == after and killed is None:
            killed = next(n for n in nodes if req.request_id in n.worker.generate_calls)
            await killed.server.stop(grace=0)
    return deltas, killed


def texts(deltas: list[Delta], n: int) -> list[str]:
    return ["".join(d.text for d in deltas if d.index == i) for i in range(n)]


async def test_n3_seeded_request_migrates_every_choice(tok: Tokenizer) -> None:
    sp = dict(max_tokens=30, temperature=1.0, seed=77, n=3, logprobs=1, ignore_eos=True)
    prompt = tuple((i * 7 + 3) % 120 + 2 for i in range(20))

    def req(rid: str) -> ProcessRequest:
        return ProcessRequest(rid, prompt_ids=prompt, model=MODEL, sampling=SamplingParams(**sp))

    async with two_workers(tok, tiny_engine) as (p, nodes, router):
        ref = [d async for d in p.generate(req("ref"))]
        assert len(set(texts(ref, 3))) == 3  # three different choices
        deltas, killed = await run_killing_after(p, req("mig"), nodes, after=6)
        assert killed is not None
        survivor = next(n for n in nodes if n is not killed)
        # every choice really moved, each as its own request
        assert {"mig.0", "mig.1", "mig.2"} <= set(survivor.worker.generate_calls)
        assert texts(deltas, 3) == texts(ref, 3)
        for i in range(3):
            got = [x.token_bytes for d in deltas if d.index == i for x in d.logprobs]
            assert got == [x.token_bytes for d in ref if d.index == i for x in d.logprobs]
            (fin,) = [d for d in deltas if d.index == i and d.finish_reason is not None]
            assert fin.finish_reason == "length"
            # The choice's running token count goes on across its move, to its 30 tokens.
            counts = [d.tokens for d in deltas[:-1] if d.index == i]  # [-1]: the usage's
            assert counts == sorted(counts) and fin.tokens == 30
            assert {d.prompt_tokens for d in deltas} == {len(prompt)}
        assert deltas[-1].usage is not None and deltas[-1].usage.completion_tokens == 90
        assert p.metrics.registry.get_sample_value("tandem_processor_migrations_total") == 3
        for w in ("w0", "w1"):
            assert router.load.inflight_count(w) == 0
        await survivor.engine.check_integrity()


async def test_n3_on_a_draining_worker_is_handed_back_and_replays_each_choice(
        tok: Tokenizer) -> None:
    sp = dict(max_tokens=30, temperature=1.0, seed=5, n=3, ignore_eos=True)
    prompt = tuple((i * 5 + 1) % 120 + 2 for i in range(20))

    def req(rid: str) -> ProcessRequest:
        return ProcessRequest(rid, prompt_ids=prompt, model=MODEL, sampling=SamplingParams(**sp))

    async with two_workers(tok, tiny_engine) as (p, nodes, router):
        ref = [d async for d in p.generate(req("ref"))]
        deltas, src = await run_draining_after(p, req("mv"), nodes, router, 6)
        dst = next(n for n in nodes if n is not src)
        assert {"mv.0", "mv.1", "mv.2"} <= set(dst.worker.generate_calls)
        assert texts(deltas, 3) == texts(ref, 3)
        assert deltas[-1].usage is not None and deltas[-1].usage.completion_tokens == 90
        assert metric(src, "tandem_worker_requests_moved_total", outcome="handed_back") == 1
        reg = p.metrics.registry
        assert reg.get_sample_value("tandem_processor_moves_total", {"kind": "replay"}) == 1
        assert reg.get_sample_value("tandem_processor_migrations_total") == 0  # a drain is no failure
        for w in ("w0", "w1"):
            assert router.load.inflight_count(w) == 0
        await assert_no_leaks(*nodes)


async def test_n2_refused_at_start_moves_whole(tok: Tokenizer) -> None:
    """The router still lists a worker whose server is gone and picks it: nothing was
    produced, so the request moves as one, its choices sharing one prefill on the other
    worker."""
    sp = dict(max_tokens=20, temperature=1.0, seed=9, n=2, ignore_eos=True)
    prompt = tuple((i * 3 + 2) % 120 + 2 for i in range(40))

    def req(rid: str, **over: object) -> ProcessRequest:
        return ProcessRequest(rid, prompt_ids=prompt, model=MODEL,
                              sampling=SamplingParams(**{**sp, **over}))

    async with two_workers(tok, tiny_engine) as (p, nodes, router):
        ref = [d async for d in p.generate(req("ref"))]
        dead = next(n for n in nodes if "ref" in n.worker.generate_calls)
        survivor = next(n for n in nodes if n is not dead)
        await dead.server.stop(grace=0)
        route = router.route

        async def dead_first(r: RouteRequest) -> RouteResponse:
            if not r.exclude_workers:  # the first pick: the dead worker
                r = replace(r, exclude_workers=(survivor.worker.worker_id,))
            return await route(r)

        router.route = dead_first  # type: ignore[method-assign]
        deltas = [d async for d in p.generate(req("r"))]
        first, *again = [resp for r, resp in router.routed if r.request_id == "r"]
        assert first.worker_id == dead.worker.worker_id and len(again) == 1
        assert "r" in survivor.worker.generate_calls
        assert not any(c.startswith("r.") for c in survivor.worker.generate_calls)
        assert texts(deltas, 2) == texts(ref, 2)
        assert p.metrics.registry.get_sample_value("tandem_processor_migrations_total") == 1
        for w in ("w0", "w1"):
            assert router.load.inflight_count(w) == 0


def _json_request(tok: Tokenizer, rid: str, **sampling: object) -> ProcessRequest:
    spec = StructuredOutput.json_schema(SCHEMA)
    return ProcessRequest(rid, messages=(ChatMessage("user", "Describe a person as JSON."),),
                          model=MODEL, sampling=SamplingParams(structured=spec, **sampling))


@pytest.mark.parametrize("sampling", [
    {"temperature": 0.0, "max_tokens": 48},
    {"temperature": 0.8, "seed": 5, "n": 2, "max_tokens": 48},
], ids=["greedy", "seeded-n2"])
async def test_grammar_request_migrates_with_its_matcher(tok: Tokenizer, smollm2, sampling) -> None:
    n = int(sampling.get("n", 1))

    def engine(worker_id: str, seed: int) -> LLMEngine:
        return smollm2_engine(smollm2, tok, worker_id, seed)

    async with two_workers(tok, engine) as (p, nodes, router):
        ref = [d async for d in p.generate(_json_request(tok, "ref", **sampling))]
        deltas, killed = await run_killing_after(p, _json_request(tok, "mig", **sampling),
                                                 nodes, after=3)
        assert killed is not None
        survivor = next(n for n in nodes if n is not killed)
        moved = {"mig"} if n == 1 else {f"mig.{i}" for i in range(n)}
        assert moved <= set(survivor.worker.generate_calls)
        assert texts(deltas, n) == texts(ref, n)
        for i, text in enumerate(texts(deltas, n)):
            (fin,) = [d for d in deltas if d.index == i and d.finish_reason is not None]
            if fin.finish_reason == "stop":
                assert set(json.loads(text)) == set(SCHEMA["properties"])
        for w in ("w0", "w1"):
            assert router.load.inflight_count(w) == 0
        await survivor.engine.check_integrity()
