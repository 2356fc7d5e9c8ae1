"""Issue 13's sampling fields with the real SmolLM2 behind the real hops (official openai
client -> frontend -> processor -> router -> decode worker -> torch engine): logprobs
equal a reference log_softmax of a second runner's logits over the same weights,
streaming and not agree, penalties, logit_bias and min_tokens change what the model says."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import openai
import pytest
import torch

from services.api.sampling import choice_seed
from services.common.config import ClusterConfig, parse_config
from services.engine.batch import ScheduledBatch
from services.engine.engine import LLMEngine
from services.engine.runner.torch_runner import TorchRunner
from services.model.tokenizer import Tokenizer
from tests.support.cluster import running_cluster
from tests.support.mock_cluster import MODEL
from tests.support.stack import worker_decode_node
from tests.support.tiny_model import seq

pytestmark = pytest.mark.model

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def tok(smollm2_path: Path) -> Tokenizer:
    return Tokenizer.from_path(smollm2_path)


def _cfg(nats_url: str) -> ClusterConfig:
    return parse_config({"namespace": "samp", "nats": {"url": nats_url}, "model": {"name": MODEL},
                         # float32: the assertions compare greedy answers and logprobs
                         # across batch shapes and prefix hits, which bfloat16 (+ int4) can
                         # flip at a near-tie.
                         "engine": {"num_kv_blocks": 64, "max_model_len": 1024,
                                    "dtype": "float32", "quantization": "none"},
                         # a long TTL: loading the reference runner in the test's own
                         # event loop stalls the leases' heartbeats for seconds under load
                         "discovery": {"ttl_s": 30.0, "heartbeat_s": 0.5}})


@pytest.fixture
async def served(nats_url: str, tok: Tokenizer) -> AsyncIterator[tuple[openai.AsyncOpenAI, LLMEngine]]:
    from services.engine.factory import build_engine

    cfg = _cfg(nats_url)
    parts = build_engine(cfg, worker_id="w0")
    async with running_cluster(cfg, tok, node_factory=lambda: worker_decode_node(
            cfg, tok, engine=parts.engine)) as c:
        yield openai.AsyncOpenAI(base_url=c.url + "/v1", api_key="x", max_retries=0), parts.engine


@pytest.fixture
def client(served: tuple[openai.AsyncOpenAI, LLMEngine]) -> openai.AsyncOpenAI:
    return served[0]


def _reference_next_logprobs(nats_url: str, ids: list[int]) -> torch.Tensor:
    """log_softmax of the next-token logits from a runner of its own (same weights)."""
    from services.engine.factory import build_engine

    runner = build_engine(_cfg(nats_url), worker_id="ref").engine.runner
    assert isinstance(runner, TorchRunner)
    blocks = list(range(-(-len(ids) // runner.block_size)))
    logits = runner.logits_for(ScheduledBatch([seq("ref", ids, 0, blocks)]))
    return torch.log_softmax(logits[0], -1)


async def test_logprobs_equal_the_reference_and_stream_agrees(
        client: openai.AsyncOpenAI, tok: Tokenizer, nats_url: str) -> None:
    ids = tok.encode(PROMPT)
    comp = await client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0,
                                           logprobs=5)
    lp = comp.choices[0].logprobs
    assert lp is not None and len(lp.tokens) == len(lp.token_logprobs) == 6
    ref = _reference_next_logprobs(nats_url, ids)
    top = ref.topk(5)
    first = int(top.indices[0])
    assert lp.tokens[0] == tok.decode([first], skip_special_tokens=False)
    assert lp.token_logprobs[0] == pytest.approx(float(ref[first]), abs=2e-3)
    want = {tok.decode([int(t)], skip_special_tokens=False): float(v)
            for t, v in zip(top.indices, top.values, strict=True)}
    assert lp.top_logprobs[0].keys() == want.keys()
    for k, v in want.items():
        assert lp.top_logprobs[0][k] == pytest.approx(v, abs=2e-3)

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    full = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                                temperature=0, logprobs=True, top_logprobs=3)
    content = full.choices[0].logprobs.content
    assert len(content) == full.usage.completion_tokens
    for e in content:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        assert e.top_logprobs[0].token == e.token  # greedy: the chosen token is the top one
    stream = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                                  temperature=0, logprobs=True, top_logprobs=3,
                                                  stream=True)
    streamed = []
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed.extend(chunk.choices[0].logprobs.content or [])
    # The streamed request hits the first one's prefix cache and computes only the tail: the
    # matmuls' shapes differ, and on some CPUs (an Intel Xeon without AVX512-BF16) float32
    # rounds differently by ~1e-5. Same tokens; logprobs equal to well within that.
    assert [e.token for e in streamed] == [e.token for e in content]
    for s, c in zip(streamed, content, strict=True):
        assert s.logprob == pytest.approx(c.logprob, abs=1e-4)


async def test_penalties_bias_and_min_tokens_change_the_answer(client: openai.AsyncOpenAI,
                                                              tok: Tokenizer) -> None:
    ids = tok.encode("1, 2, 1, 2, 1, 2, 1, 2,")

    async def repeats(**kw: object) -> int:
        r = await client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0,
                                            **kw)
        return r.choices[0].text.count("1, 2")

    free = await repeats()
    assert free >= 2, "greedy SmolLM2 continues the pattern"
    assert await repeats(extra_body={"repetition_penalty": 3.0}) < free
    assert await repeats(frequency_penalty=2.0, presence_penalty=2.0) < free

    base = await client.completions.create(model=MODEL, prompt=tok.encode(PROMPT), max_tokens=3,
                                           temperature=0, logprobs=0)
    first = tok.encode(base.choices[0].logprobs.tokens[0])
    banned = await client.completions.create(model=MODEL, prompt=tok.encode(PROMPT), max_tokens=3,
                                             temperature=0, logprobs=0,
                                             logit_bias={str(first[0]): -100})
    assert banned.choices[0].logprobs.tokens[0] != base.choices[0].logprobs.tokens[0]

    messages = [{"role": "user", "content": "Answer with one word: the capital of France?"}]
    short = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40,
                                                 temperature=0)
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 20
    longer = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40,
                                                  temperature=0, extra_body={"min_tokens": 20})
    assert longer.usage.completion_tokens >= 20


async def test_n_choices_are_reproducible_and_prefill_once(
        served: tuple[openai.AsyncOpenAI, LLMEngine], tok: Tokenizer) -> None:
    client, engine = served
    messages = [{"role": "user", "content": "Write a short poem about the sea."}]
    prompt_len = len(tok.encode_chat(messages))
    before = engine.stats().prompt_tokens_total
    kw = dict(model=MODEL, messages=messages, max_tokens=12, temperature=1.0, seed=2024, n=4,
              logprobs=True)
    first = await client.chat.completions.create(**kw)
    assert engine.stats().prompt_tokens_total - before == prompt_len, "the prompt is prefilled once"
    assert first.usage.prompt_tokens == prompt_len
    texts = [c.message.content for c in sorted(first.choices, key=lambda c: c.index)]
    assert [c.index for c in first.choices] == [0, 1, 2, 3] and len(set(texts)) > 1
    # usage counts every choice's tokens (one logprob per token).
    assert first.usage.completion_tokens == sum(len(c.logprobs.content) for c in first.choices)

    again = await client.chat.completions.create(**kw)
    assert [c.message.content for c in sorted(again.choices, key=lambda c: c.index)] == texts

    # Streaming, the same seed: the same four texts, assembled per index.
    stream = await client.chat.completions.create(**kw, stream=True)
    parts = {i: "" for i in range(4)}
    finish: dict[int, str] = {}
    async for chunk in stream:
        for c in chunk.choices:
            parts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert [parts[i] for i in range(4)] == texts and set(finish) == {0, 1, 2, 3}

    # Choice 0 is the n=1 request with the same seed; choice i draws with a seed mixed from
    # (seed, i): choice_seed, not seed + i (choice 1 of one seed is no other seed's choice 0).
    single = await client.chat.completions.create(**{**kw, "n": 1})
    assert single.choices[0].message.content == texts[0]
    mixed = await client.chat.completions.create(**{**kw, "n": 1, "seed": choice_seed(2024, 2)})
    assert mixed.choices[0].message.content == texts[2]


async def test_n_choices_each_follow_the_grammar_with_logprobs(client: openai.AsyncOpenAI) -> None:
    """Every choice has its own grammar matcher (each answer is one of the options), and
    logprobs come from the masked logits: each chosen token's is finite."""
    options = ["red", "green", "blue"]
    r = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=8,
        temperature=1.0, seed=3, n=3, logprobs=True, top_logprobs=2,
        extra_body={"guided_choice": options})
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    for c in r.choices:
        assert c.message.content in options
        assert all(-9999 < e.logprob <= 0 for e in c.logprobs.content)
