"""Migration in the processor: two real decode workers (mock-runner engines) on real gRPC
servers, an in-process Router; the serving worker's server is stopped mid-stream and the
stream must continue on the other worker with exactly the text of an undisturbed run."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack
from pathlib import Path

import pytest

from services.api.processor import ChatMessage, ProcessRequest
from services.api.route import RouteRequest
from services.api.sampling import SamplingParams
from services.common.address_book import ChannelPool
from services.common.discovery import Registration
from services.common.errors import Unavailable
from services.common.hashing import local_block_hashes
from services.model.tokenizer import Tokenizer
from services.router.errors import NoWorkersAvailable
from services.router.router import Router
from tests.support.mock_cluster import MODEL, mock_cluster_cfg
from tests.support.stack import RecordingRouter, make_processor, worker_decode_node

CTX = 512
BS = 16  # mock_cluster_cfg's engine.block_size


@pytest.fixture(scope="module")
def tok(smollm2_path: Path) -> Tokenizer:
    return Tokenizer.from_path(smollm2_path)


def chat(rid: str, **sampling) -> ProcessRequest:
    return ProcessRequest(rid, messages=(ChatMessage("user", "Tell me a story"),), model=MODEL,
                          sampling=SamplingParams(**sampling))


async def _run_killing_after(p, req, nodes, after: int):
    """Consume ``req``; after ``after`` deltas stop the gRPC server of the node serving it."""
    deltas, killed = [], None
    async for d in p.generate(req):
        deltas.append(d)
        if len(deltas) == after and killed is None:
            killed = next(n for n in nodes if req.request_id in n.worker.generate_calls)
            await killed.server.stop(grace=0)
    return deltas, killed


async def test_stream_migrates_with_identical_text_and_usage(tok: Tokenizer) -> None:
    cfg = mock_cluster_cfg(engine={"mock": {"step_base_s": 0.01}})
    router = RecordingRouter(cfg)
    pool = ChannelPool()
    async with AsyncExitStack() as stack:
        nodes = [await stack.enter_async_context(worker_decode_node(cfg, tok, f"w{i}"))
                 for i in range(2)]
        for i, n in enumerate(nodes):
            router.worker_joined(Registration("decode", f"w{i}", address=n.address))
        p = make_processor(cfg, tok, router, CTX, pool)
        ref = [d async for d in p.generate(chat("ref", max_tokens=40, temperature=0))]
        deltas, killed = await _run_killing_after(p, chat("mig", max_tokens=40, temperature=0),
                                                  nodes, after=5)
        assert killed is not None
        survivor = next(n for n in nodes if n is not killed)
        assert "mig" in survivor.worker.generate_calls  # the stream really moved
        assert "".join(d.text for d in deltas) == "".join(d.text for d in ref)
        assert deltas[-1].finish_reason == ref[-1].finish_reason == "length"
        assert deltas[-1].usage.completion_tokens == 40
        assert deltas[-1].usage.prompt_tokens == ref[-1].usage.prompt_tokens
        assert p.metrics.registry.get_sample_value("tandem_processor_migrations_total") == 1
        # The re-route names the blocks of prompt + produced tokens, hashed by the processor.
        first, again = [req for req, _ in router.routed if req.request_id == "mig"]
        ids = tok.encode_chat([{"role": "user", "content": "Tell me a story"}])
        assert list(first.local_hashes) == local_block_hashes(ids, BS)
        runner = survivor.engine.engine.runner
        out = list(ids)
        for _ in range(40):
            out.append(runner.next_token(out))
        assert any(list(again.local_hashes) == local_block_hashes(out[: len(ids) + k], BS)
                   for k in range(5, 40))
        assert tuple(again.exclude_workers) == ("w0" if killed is nodes[0] else "w1",)
        for w in ("w0", "w1"):
            assert router.load.inflight_count(w) == 0
        await survivor.engine.check_integrity()
    await pool.close()


async def test_an_echo_with_prompt_logprobs_migrates_with_the_prompt_echoed_once(
        tok: Tokenizer) -> None:
    cfg = mock_cluster_cfg(engine={"mock": {"step_base_s": 0.01}})
    router = RecordingRouter(cfg)
    pool = ChannelPool()
    prompt = "Once upon a time there was"

    def echo(rid: str) -> ProcessRequest:
        return ProcessRequest(rid, prompt=prompt, model=MODEL, echo=True, sampling=SamplingParams(
            max_tokens=30, temperature=0, logprobs=0, prompt_logprobs=0))

    async with AsyncExitStack() as stack:
        nodes = [await stack.enter_async_context(worker_decode_node(cfg, tok, f"w{i}"))
                 for i in range(2)]
        for i, n in enumerate(nodes):
            router.worker_joined(Registration("decode", f"w{i}", address=n.address))
        p = make_processor(cfg, tok, router, CTX, pool)
        ref = [d async for d in p.generate(echo("ref"))]
        deltas, killed = await _run_killing_after(p, echo("mig"), nodes, after=3)
        assert killed is not None
        survivor = next(n for n in nodes if n is not killed)
        assert "mig" in survivor.worker.generate_calls  # the stream really moved
        text = "".join(d.text for d in deltas)
        assert text.startswith(prompt) and text == "".join(d.text for d in ref)
        lps = [x for d in deltas for x in d.logprobs]
        assert lps == [x for d in ref for x in d.logprobs]
        assert len(lps) == len(tok.encode(prompt)) + 30 and lps[0].logprob is None
        assert [x.logprob is None for x in lps].count(True) == 1
        await survivor.engine.check_integrity()
    await pool.close()


async def test_stop_string_state_carries_over_a_migration(tok: Tokenizer) -> None:
    cfg = mock_cluster_cfg(engine={"mock": {"step_base_s": 0.01}})
    router = Router(cfg)
    pool = ChannelPool()
    async with AsyncExitStack() as stack:
        nodes = [await stack.enter_async_context(worker_decode_node(cfg, tok, f"w{i}"))
                 for i in range(2)]
        for i, n in enumerate(nodes):
            router.worker_joined(Registration("decode", f"w{i}", address=n.address))
        p = make_processor(cfg, tok, router, CTX, pool)
        full = "".join(d.text for d in [d async for d in p.generate(chat("f", max_tokens=60, temperature=0))])
        # A stop string from late in the text, so the match happens after the migration.
        stop = full[len(full) * 2 // 3:][:6]
        assert stop.strip(), full
        ref = [d async for d in p.generate(chat("ref", max_tokens=60, temperature=0, stop=(stop,)))]
        deltas, killed = await _run_killing_after(
            p, chat("mig", max_tokens=60, temperature=0, stop=(stop,)), nodes, after=3)
        assert killed is not None
        assert "".join(d.text for d in deltas) == "".join(d.text for d in ref) == full[:full.index(stop)]
        assert deltas[-1].finish_reason == "stop"
    await pool.close()


async def test_no_worker_left_is_a_clear_unavailable(tok: Tokenizer) -> None:
    cfg = mock_cluster_cfg(engine={"mock": {"step_base_s": 0.01}})
    router = Router(cfg)
    pool = ChannelPool()
    async with worker_decode_node(cfg, tok, "w0") as node:
        router.worker_joined(Registration("decode", "w0", address=node.address))
        p = make_processor(cfg, tok, router, CTX, pool)
        with pytest.raises(Unavailable, match="no other decode worker can continue it") as e:
            await asyncio.wait_for(_run_killing_after(p, chat("x", max_tokens=100), [node], 3), 20)
        assert "w0" in e.value.message
        assert router.load.inflight_count("w0") == 0
        assert p.metrics.registry.get_sample_value(
            "tandem_processor_requests_total", {"outcome": "unavailable"}) == 1
    await pool.close()


async def test_router_excludes_workers() -> None:
    cfg = mock_cluster_cfg()
    router = Router(cfg)
    for w in ("a", "b"):
        router.worker_joined(Registration("decode", w, address=f"{w}:1"))
    for i in range(8):
        r = await router.route(RouteRequest(f"r{i}", list(range(40)), exclude_workers=("a",)))
        assert r.worker_id == "b"
    with pytest.raises(NoWorkersAvailable, match="excluded"):
        await router.route(RouteRequest("z", list(range(40)), exclude_workers=("a", "b")))


@pytest.mark.parametrize("sampling", [
    {"temperature": 0.0},
    {"temperature": 1.0, "seed": 1234},
    {"temperature": 0.8, "top_p": 0.9, "seed": 7},
    # The penalty counts of a migrated request start from the tokens it produced already.
    {"temperature": 1.0, "seed": 3, "frequency_penalty": 1.5, "presence_penalty": 0.5,
     "repetition_penalty": 1.4, "logit_bias": ((9, 2.0),)},
    {"temperature": 0.0, "frequency_penalty": 2.0},
])
def test_continuation_on_a_fresh_engine_reproduces_the_tail(sampling) -> None:
    """What migration relies on in the engine: prompt + the first k produced tokens, with
    max_tokens - k and seed_step_offset k, yields exactly the remaining tokens of the whole
    run (tiny random llama, real sampler; a different engine generator seed stands for
    another worker)."""
    from services.api.sampling import SamplingParams
    from services.common.config import EngineConfig
    from services.engine.engine import LLMEngine
    from services.engine.request import GenerateRequest
    from tests.support.engine_factory import run_all
    from tests.support.tiny_model import make_runner, tiny_hf_model

    hf, arch = tiny_hf_model("llama")
    prompt, k, n = [5, 17, 99, 3, 42, 8, 61, 77, 23, 1], 4, 10

    def run(seed: int, ids: list[int], sp: SamplingParams) -> list[int]:
        cfg = EngineConfig(device="cpu", dtype="float32", block_size=4, num_kv_blocks=64, seed=seed)
        engine = LLMEngine(make_runner(arch, hf.state_dict(), seed=seed), cfg, [], "w")
        engine.add_request(GenerateRequest("r", ids, sp))
        return run_all(engine)["r"]

    whole = run(1, prompt, SamplingParams(max_tokens=n, ignore_eos=True, **sampling))
    tail = run(2, prompt + whole[:k], SamplingParams(max_tokens=n - k, ignore_eos=True,
                                                     seed_step_offset=k, **sampling))
    assert len(whole) == n and whole[k:] == tail


class _SlowTorchRunner:
    """A tiny-llama TorchRunner whose steps take 20 ms: the stream is still running when
    the test stops its worker."""

    @staticmethod
    def make(seed: int):
        import time

        from services.common.config import EngineConfig
        from services.engine.runner.torch_runner import TorchRunner
        from tests.support.tiny_model import tiny_hf_model

        hf, arch = tiny_hf_model("llama")

        class Slow(TorchRunner):
            def execute(self, batch):
                time.sleep(0.02)
                return super().execute(batch)

        cfg = EngineConfig(device="cpu", dtype="float32", block_size=BS, num_kv_blocks=64,
                           seed=seed, overlap=False)
        return Slow(arch, hf.state_dict(), cfg), cfg


async def test_seeded_penalised_request_migrates_to_the_same_text_and_logprobs(tok: Tokenizer) -> None:
    """A sampled request with a seed, penalties and logprobs, served by real torch engines
    (different engine seeds: different workers), moved mid-stream: the same text and
    logprobs as an undisturbed run."""
    from services.engine.engine import LLMEngine

    cfg = mock_cluster_cfg(engine={"block_size": BS})
    router = RecordingRouter(cfg)
    pool = ChannelPool()
    sp = dict(max_tokens=30, temperature=1.0, seed=77, frequency_penalty=1.0,
              presence_penalty=0.5, repetition_penalty=1.3, logprobs=2, ignore_eos=True)
    prompt = tuple((i * 7 + 3) % 120 + 2 for i in range(20))
    async with AsyncExitStack() as stack:
        nodes = []
        for i in range(2):
            runner, ecfg = _SlowTorchRunner.make(seed=100 + i)
            engine = LLMEngine(runner, ecfg, [], f"w{i}")
            nodes.append(await stack.enter_async_context(
                worker_decode_node(cfg, tok, f"w{i}", engine=engine)))
            router.worker_joined(Registration("decode", f"w{i}", address=nodes[i].address))
        p = make_processor(cfg, tok, router, CTX, pool)

        def req(rid: str) -> ProcessRequest:
            return ProcessRequest(rid, prompt_ids=prompt, model=MODEL, sampling=SamplingParams(**sp))

        ref = [d async for d in p.generate(req("ref"))]
        deltas, killed = await _run_killing_after(p, req("mig"), nodes, after=4)
        assert killed is not None
        survivor = next(n for n in nodes if n is not killed)
        assert "mig" in survivor.worker.generate_calls  # the stream really moved
        assert "".join(d.text for d in deltas) == "".join(d.text for d in ref)
        got = [x for d in deltas for x in d.logprobs]
        want = [x for d in ref for x in d.logprobs]
        assert len(got) == deltas[-1].usage.completion_tokens == 30
        assert [x.token for x in got] == [x.token for x in want]
        assert [x.logprob for x in got] == pytest.approx([x.logprob for x in want], abs=1e-5)
    await pool.close()
