"""The Processor over the real decode worker (mock-runner engine) on real gRPC, with an
in-process Router: text, stop strings, usage, errors, cancellation."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from services.api.processor import ChatMessage, ProcessRequest
from services.api.route import RequestPhase, RouteRequest
from services.api.sampling import SamplingParams
from services.common.address_book import ChannelPool
from services.common.discovery import Registration
from services.common.errors import InvalidRequest, ModelNotFound, Unavailable
from services.common.hashing import block_hashes, local_block_hashes
from services.model.tokenizer import Tokenizer
from services.router.router import Router
from tests.support.mock_cluster import MODEL, mock_cluster_cfg
from tests.support.stack import RecordingRouter, make_processor, worker_decode_node

CTX = 512


@pytest.fixture(scope="module")
def tok(smollm2_path: Path) -> Tokenizer:
    return Tokenizer.from_path(smollm2_path)


async def collect(p, req):
    out = []
    async for d in p.generate(req):
        out.append(d)
    return out


def chat(rid: str, text: str = "Hello there", **sampling) -> ProcessRequest:
    return ProcessRequest(rid, messages=(ChatMessage("user", text),), model=MODEL,
                          sampling=SamplingParams(**sampling))


async def test_stream_text_usage_and_router_bookkeeping(tok: Tokenizer) -> None:
    cfg = mock_cluster_cfg()
    router = Router(cfg)  # in-process, fed by hand (no NATS in a unit test)
    pool = ChannelPool()
    async with worker_decode_node(cfg, tok) as node:
        router.worker_joined(Registration("decode", "w0", address=node.address))
        p = make_processor(cfg, tok, router, CTX, pool)
        deltas = await collect(p, chat("r1", max_tokens=12, temperature=0))
        *body, last = deltas
        assert all(d.finish_reason is None and d.usage is None for d in body)
        assert last.finish_reason == "length"
        prompt_ids = tok.encode_chat([{"role": "user", "content": "Hello there"}])
        assert last.usage is not None
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(prompt_ids), 12)
        # The text is exactly the tokens the engine produced, decoded (same mock oracle).
        runner = node.engine.engine.runner
        toks = list(prompt_ids)
        for _ in range(12):
            toks.append(runner.next_token(toks))
        assert "".join(d.text for d in deltas) == tok.decode(toks[len(prompt_ids):])
        assert router.load.inflight_count("w0") == 0  # FINISHED was reported
        # Same prompt again: the prefix is cached on the worker and usage says so.
        again = await collect(p, chat("r2", max_tokens=2, temperature=0))
        assert again[-1].usage.cached_tokens >= 16
        await node.engine.check_integrity()
    await pool.close()


async def test_stop_string_truncates_and_aborts_the_worker(tok: Tokenizer) -> None:
    cfg = mock_cluster_cfg()
    router = Router(cfg)
    pool = ChannelPool()
    async with worker_decode_node(cfg, tok) as node:
        router.worker_joined(Registration("decode", "w0", address=node.address))
        p = make_processor(cfg, tok, router, CTX, pool)
        full = "".join(d.text for d in await collect(p, chat("a", max_tokens=40, temperature=0)))
        assert len(full) > 20
        stop = full[10:14]
        cut = full[: full.index(stop)]
        deltas = await collect(p, chat("b", max_tokens=40, temperature=0, stop=(stop,)))
        text = "".join(d.text for d in deltas)
        assert text == cut and stop not in text
        assert deltas[-1].finish_reason == "stop"
        assert deltas[-1].usage.completion_tokens < 40  # stopped early
        assert router.load.inflight_count("w0") == 0
        await _eventually_idle(node)
    await pool.close()


async def test_cancelling_the_consumer_aborts_on_the_engine(tok: Tokenizer) -> None:
    cfg = mock_cluster_cfg(engine={"mock": {"step_base_s": 0.01}})
    router = Router(cfg)
    pool = ChannelPool()
    async with worker_decode_node(cfg, tok) as node:
        router.worker_joined(Registration("decode", "w0", address=node.address))
        p = make_processor(cfg, tok, router, CTX, pool)
        got_one = asyncio.Event()

        async def consume() -> None:
            async for _ in p.generate(chat("long", max_tokens=400)):
                got_one.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(got_one.wait(), 10)
        assert node.engine.stats().kv_blocks_used > 0
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _eventually_idle(node)
        assert router.load.inflight_count("w0") == 0
    await pool.close()


async def test_errors_are_typed(tok: Tokenizer) -> None:
    cfg = mock_cluster_cfg()
    router = Router(cfg)
    pool = ChannelPool()
    p = make_processor(cfg, tok, router, 64, pool)
    with pytest.raises(InvalidRequest, match="maximum context length is 64 tokens") as e:
        await collect(p, ProcessRequest("x", prompt="word " * 100, model=MODEL))
    assert e.value.code == "context_length_exceeded" and e.value.param == "prompt"
    with pytest.raises(InvalidRequest, match="empty"):
        await collect(p, ProcessRequest("x", prompt="", model=MODEL))
    # NOTE: a bad sampling value cannot be built: SamplingParams refuses it where the
    # request enters a process (tests/unit/api/test_codec.py checks the gRPC entries).
    with pytest.raises(InvalidRequest, match="stop_token_ids") as e:
        await collect(p, chat("x", stop_token_ids=(1 << 20,)))
    with pytest.raises(ModelNotFound, match="nope"):
        await collect(p, ProcessRequest("x", prompt="hi", model="nope"))
    with pytest.raises(Unavailable, match="no decode workers"):
        await collect(p, chat("x"))
    assert p.metrics.registry.get_sample_value(
        "tandem_processor_requests_total", {"outcome": "invalid_request"}) == 3


async def test_routes_carry_the_prompts_block_hashes(tok: Tokenizer) -> None:
    """The processor hashes the prompt (the router need not): the route names the blocks of
    ``local_block_hashes(ids, block_size)`` and goes where the token ids would have gone."""
    cfg = mock_cluster_cfg()
    bs = cfg.engine.block_size
    router = RecordingRouter(cfg, seed=0)
    pool = ChannelPool()
    text = "Summarise the following. " + "The quick brown fox jumps over the lazy dog. " * 8
    ids = tok.encode_chat([{"role": "user", "content": text}])
    assert len(ids) > 4 * bs
    async with worker_decode_node(cfg, tok) as node:
        for w in ("w0", "w1", "w2"):
            router.worker_joined(Registration("decode", w, address=node.address))
        # w1 caches the first 3 blocks of this prompt: it is the worker to pick
        held = block_hashes(ids[: 3 * bs], bs)
        router.index.apply_stored("w1", None, [b.seq_hash for b in held], [b.local_hash for b in held])
        p = make_processor(cfg, tok, router, CTX, pool)
        await collect(p, chat("r1", text, max_tokens=3, temperature=0))
        (req, got), = router.routed
        assert list(req.local_hashes) == local_block_hashes(ids, bs) and not req.token_ids
        assert (got.worker_id, got.overlap_blocks, got.request_blocks) == ("w1", 3, len(ids) // bs)
        by_ids = await router.route(RouteRequest("probe", ids))  # the same state, as token ids
        assert (by_ids.worker_id, by_ids.overlap_blocks) == (got.worker_id, got.overlap_blocks)
        await router.update("probe", RequestPhase.FINISHED)
        # a prompt under one block has no hashes: it goes as its token ids
        await collect(p, ProcessRequest("short", prompt_ids=(5, 6, 7), model=MODEL,
                                        sampling=SamplingParams(max_tokens=2)))
        req, got = router.routed[-1]
        assert list(req.token_ids) == [5, 6, 7] and not req.local_hashes
        assert got.request_blocks == 0
    await pool.close()


async def _eventually_idle(node) -> None:
    for _ in range(500):
        if node.engine.stats().kv_blocks_used == 0 and node.engine.stats().num_running == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"engine still busy: {node.engine.stats()}")

