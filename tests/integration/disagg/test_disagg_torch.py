"""Remote prefill through the real torch engine equals local prefill: a tiny random
Hugging Face model built in the test, and the real SmolLM2, for prompts above and below
the threshold (greedy; plus a seeded sampled request on the tiny model)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from services.api.sampling import SamplingParams
from services.api.worker_codec import generate_request_to_pb
from services.decode import worker as decode_worker_module
from services.disagg.prefill_outcome import PrefillLocation
from services.engine.request import GenerateRequest
from services.prefill import kv_sender
from tests.support.disagg_harness import (
    decode_worker,
    generate,
    metric,
    prefill_worker,
    settle,
)
from tests.support.mock_cluster import cluster_cfg

pytestmark = pytest.mark.asyncio

VOCAB = 128


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(11)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
        initializer_range=0.15, bos_token_id=1, eos_token_id=0)).eval()
    model.save_pretrained(out, safe_serialization=True)
    vocab = {f"t{i}": i for i in range(VOCAB)}
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t0", "bos_token": "t1"}))
    return out


def _engine(**kw):
    return {"runner": "torch", "device": "cpu", "dtype": "float32", "block_size": 4,
            "num_kv_blocks": 96, "max_num_seqs": 4, "max_num_batched_tokens": 64, **kw}


async def _reference(ae, rid: str, prompt: list[int], sp: SamplingParams) -> list[int]:
    toks: list[int] = []
    async for o in ae.generate(GenerateRequest(rid, prompt, sp)):
        toks += o.token_ids
    return toks


@pytest.mark.parametrize(("kv_transport", "same_host", "used"), [
    ("auto", True, "shm"), ("grpc", True, "grpc"), ("auto", False, "grpc")],
    ids=["shm", "grpc-by-config", "grpc-other-host"])
async def test_tiny_model_remote_equals_local(nats_url: str, tiny_model_dir: Path, kv_transport: str,
                                              same_host: bool, used: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    if not same_host:  # the decode worker advertises another host's id in its jobs
        monkeypatch.setattr(decode_worker_module, "host_id", lambda: "boot-of-another-host/1:2")
    cfg = cluster_cfg(nats_url, model={"path": str(tiny_model_dir)}, engine=_engine(max_model_len=256),
                      decode={"disagg": {"max_local_prefill_length": 16}},
                      prefill={"kv_transport": kv_transport})
    segments: list[str] = []  # the names the sender picks (recorded, not faked)
    real_name = kv_sender.new_segment_name

    def recording() -> str:
        segments.append(real_name())
        return segments[-1]

    monkeypatch.setattr(kv_sender, "new_segment_name", recording)
    long = [(i * 37 + 5) % (VOCAB - 2) + 2 for i in range(45)]  # 11 full blocks + 1 token
    short = long[:10]
    async with decode_worker(cfg) as d, prefill_worker(cfg) as p:
        r_long = await generate(d, "long", long, max_tokens=10, ignore_eos=True)
        r_short = await generate(d, "short", short, max_tokens=10, ignore_eos=True)
        seeded = await generate(d, "seeded", long[::-1], max_tokens=10, ignore_eos=True,
                                temperature=0.9, seed=1234)
        assert (r_long.where, r_short.where, seeded.where) == (
            PrefillLocation.REMOTE, PrefillLocation.LOCAL, PrefillLocation.REMOTE)
        assert metric(d.worker, "tandem_worker_prefill_total", where="remote") == 2
        assert metric(d.worker, "tandem_worker_prefill_total", where="local") == 1
        transfers = {t: p.metrics.registry.get_sample_value(
            "tandem_prefill_kv_transfers_total", {"transport": t}) or 0 for t in ("shm", "grpc")}
        assert transfers == {"shm": 0, "grpc": 0, used: 2}
        # shm: one segment, written by both transfers (the decode worker released the first
        # once its engine imported it; services/disagg/shm_pool.py)
        assert len(segments) == (1 if used == "shm" else 0)
        assert not any(os.path.exists(f"/dev/shm/{n}") for n in segments)
        await settle(d.engine, 0)
        # The local path, on the prefill worker's engine (same weights, its own cache).
        greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        assert r_long.tokens == await _reference(p.engine, "ref-long", long, greedy)
        assert r_short.tokens == await _reference(p.engine, "ref-short", short, greedy)
        sampled = SamplingParams(temperature=0.9, max_tokens=10, ignore_eos=True, seed=1234)
        assert seeded.tokens == await _reference(p.engine, "ref-seeded", long[::-1], sampled)
        assert len(r_long.tokens) == 10 and len(set(r_long.tokens + seeded.tokens)) > 3


async def test_penalties_and_logprobs_cross_remote_prefill(nats_url: str, tiny_model_dir: Path) -> None:
    """The prefill worker samples the first token under the request's penalties, bias,
    min_tokens and logprobs; the decode worker continues with the same counts: tokens and
    logprobs equal the local path's, one logprob per token."""
    cfg = cluster_cfg(nats_url, model={"path": str(tiny_model_dir)}, engine=_engine(max_model_len=256),
                      decode={"disagg": {"max_local_prefill_length": 16}})
    long = [(i * 37 + 5) % (VOCAB - 2) + 2 for i in range(45)]
    rules = dict(presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.3,
                 logit_bias=((5, 3.0),), min_tokens=4, logprobs=2)
    async with decode_worker(cfg) as d, prefill_worker(cfg) as p:
        remote = await generate(d, "pen", long, max_tokens=10, temperature=0.8, seed=9, **rules)
        assert remote.where is PrefillLocation.REMOTE
        await settle(d.engine, 0)
        local: list[int] = []
        lps = []
        sp = SamplingParams(temperature=0.8, max_tokens=10, seed=9, **rules)
        async for o in p.engine.generate(GenerateRequest("ref-pen", long, sp)):
            local += o.token_ids
            lps += o.logprobs or []
    assert remote.tokens == local and len(local) >= 4
    assert [x.token_id for x in remote.logprobs] == remote.tokens
    assert [x.logprob for x in remote.logprobs] == pytest.approx([x.logprob for x in lps], abs=1e-5)
    assert all(len(x.top) == 2 for x in remote.logprobs)


async def test_n_choices_fork_after_the_remote_kv_arrives(nats_url: str, tiny_model_dir: Path) -> None:
    """n=3 with a remote prefill: the prefill worker samples choice 0's first token, the
    decode worker forks the other choices from the imported KV; every choice equals the
    local path's, and the worker counts the prompt once."""
    cfg = cluster_cfg(nats_url, model={"path": str(tiny_model_dir)}, engine=_engine(max_model_len=256),
                      decode={"disagg": {"max_local_prefill_length": 16}})
    long = [(i * 41 + 3) % (VOCAB - 2) + 2 for i in range(38)]
    sp = SamplingParams(temperature=0.9, max_tokens=8, seed=5, n=3, ignore_eos=True, logprobs=0)
    async with decode_worker(cfg) as d, prefill_worker(cfg) as p:
        before = d.engine.engine.stats().prompt_tokens_total
        stub = d.stub
        call = stub.Generate(generate_request_to_pb("multi", long, sp))
        remote: dict[int, list[int]] = {0: [], 1: [], 2: []}
        lps: dict[int, int] = {0: 0, 1: 0, 2: 0}
        finished = set()
        async for m in call:
            remote[m.index] += m.token_ids
            lps[m.index] += len(m.logprobs)
            if m.finish_reason:
                finished.add(m.index)
        assert finished == {0, 1, 2}
        assert d.engine.engine.stats().prompt_tokens_total - before == len(long)
        assert metric(d.worker, "tandem_worker_prefill_total", where="remote") == 1
        await settle(d.engine, 0)
        local: dict[int, list[int]] = {0: [], 1: [], 2: []}
        async for o in p.engine.generate(GenerateRequest("ref-multi", long, sp)):
            local[o.index] += o.token_ids
    assert remote == local and all(len(t) == 8 for t in remote.values())
    assert lps == {0: 8, 1: 8, 2: 8}


@pytest.mark.parametrize(("dtype", "quantization"), [("float32", "none"), ("bfloat16", "auto")],
                         ids=["float32", "bfloat16-int4"])
async def test_smollm2_remote_equals_local(nats_url: str, smollm2_path: Path, dtype: str,
                                           quantization: str) -> None:
    # bfloat16-int4: what `engine.dtype: auto` and `engine.quantization: auto` pick on a
    # bfloat16 CPU; the KV travels as bfloat16 between the two workers.
    cfg = cluster_cfg(nats_url, model={"path": str(smollm2_path)},
                      engine=_engine(block_size=16, num_kv_blocks=64, max_num_batched_tokens=256,
                                     max_model_len=1024, dtype=dtype, quantization=quantization),
                      decode={"disagg": {"max_local_prefill_length": 48}})
    long = [(i * 7919 + 17) % 49000 + 100 for i in range(100)]
    short = long[:30]
    async with decode_worker(cfg) as d, prefill_worker(cfg) as p:
        r_long = await generate(d, "long", long, max_tokens=8, ignore_eos=True)
        r_short = await generate(d, "short", short, max_tokens=8, ignore_eos=True)
        assert r_long.where == PrefillLocation.REMOTE and r_short.where == PrefillLocation.LOCAL
        for w in (d, p):
            runner = w.engine.engine.runner
            assert (str(runner.dtype), runner.quantization) == (
                f"torch.{dtype}", "int4" if quantization == "auto" else "none")
        await settle(d.engine, 0)
        greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        assert r_long.tokens == await _reference(p.engine, "ref-long", long, greedy)
        assert r_short.tokens == await _reference(p.engine, "ref-short", short, greedy)


async def test_smollm2_constrained_remote_prefill_samples_under_the_grammar(
        nats_url: str, smollm2_path: Path) -> None:
    """The prefill worker compiles the same spec and samples the first token under it; the
    decode worker advances its own matcher over that token and goes on: the same JSON as a
    local run, which parses and matches the schema."""
    import jsonschema

    from services.api.structured import StructuredOutput
    from services.model.tokenizer import Tokenizer

    tok = Tokenizer.from_path(smollm2_path)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                               "rain": {"type": "boolean"}},
              "required": ["city", "rain"], "additionalProperties": False}
    structured = StructuredOutput.json_schema(schema)
    cfg = cluster_cfg(nats_url, model={"path": str(smollm2_path)},
                      engine=_engine(block_size=16, num_kv_blocks=64, max_num_batched_tokens=256,
                                     max_model_len=1024),
                      decode={"disagg": {"max_local_prefill_length": 48}})
    long = tok.encode_chat([{"role": "user", "content": "Pick a city anywhere in the world and "
                             "tell me, as JSON with the fields city and rain, whether it "
                             "rains there today. Keep it short and answer only with JSON."}])
    assert len(long) > 48
    async with decode_worker(cfg) as d, prefill_worker(cfg) as p:
        r = await generate(d, "json", long, max_tokens=40, structured=structured)
        assert r.where == PrefillLocation.REMOTE
        await settle(d.engine, 0)
        sp = SamplingParams(temperature=0.0, max_tokens=40, structured=structured)
        assert r.tokens == await _reference(p.engine, "ref-json", long, sp)
    text = tok.decode(r.tokens)
    jsonschema.validate(json.loads(text), schema)
