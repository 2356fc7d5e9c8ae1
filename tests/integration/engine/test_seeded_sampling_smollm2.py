"""Reproducible sampling on the real SmolLM2 (float32, where the logits do not move with the
batch's shape): a seeded request's tokens depend on its seed, choice, position and logits
only -- not on a prefix-cache hit, chunked prefill, its batch neighbours, the overlapped
loop, or a remote prefill."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.api.outputs import TokenOutput
from services.api.sampling import SamplingParams
from services.common.config import parse_config
from services.engine.engine import LLMEngine
from services.engine.factory import build_engine
from services.engine.request import GenerateRequest
from services.model.tokenizer import Tokenizer

pytestmark = pytest.mark.model

SEEDED = SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=16, ignore_eos=True)
Texts = dict[str, dict[int, list[int]]]


def engine(**over: object) -> LLMEngine:
    eng = {"dtype": "float32", "quantization": "none", "num_kv_blocks": 256,
           "max_model_len": 1024, "overlap": False, **over}
    return build_engine(parse_config({"engine": eng}, [])).engine


def run(eng: LLMEngine, requests: list[GenerateRequest],
        first: dict[str, TokenOutput] | None = None) -> Texts:
    """Step until idle: each request's tokens by choice (``first``: the first token of a
    remote prefill, already appended)."""
    got: Texts = {r.request_id: {} for r in requests}
    for rid, out in (first or {}).items():
        got[rid].setdefault(out.index, []).extend(out.token_ids)
    for r in requests:
        if not first or r.request_id not in first:
            eng.add_request(r)
    while eng.has_unfinished():
        for o in eng.step():
            got[o.request_id].setdefault(o.index, []).extend(o.token_ids)
    eng.check_integrity()
    return got


@pytest.fixture(scope="module")
def prompt(smollm2_path: Path) -> list[int]:
    tok = Tokenizer.from_path(smollm2_path)
    return tok.encode_chat([{"role": "user", "content": "Write a short poem about the sea, "
                                                        "the wind and a boat at night."}])


def neighbours(prompt: list[int]) -> list[GenerateRequest]:
    """31 others: other prompts, unseeded sampling and greedy, other lengths."""
    out = []
    for i in range(31):
        sp = (SamplingParams(temperature=0.8, max_tokens=8 + i % 9) if i % 2
              else SamplingParams(temperature=0, max_tokens=12))
        out.append(GenerateRequest(f"o{i}", [prompt[0], 300 + 7 * i, *prompt[1:-3]], sp))
    return out


@pytest.fixture(scope="module")
def reference(prompt: list[int]) -> dict[int, list[int]]:
    """The seeded request alone on a fresh serial engine, whole-prompt prefill."""
    return run(engine(), [GenerateRequest("s", prompt, SEEDED)])["s"]


def test_three_choices_differ_and_repeat_through_a_cache_hit(
        prompt: list[int], reference: dict[int, list[int]]) -> None:
    assert sorted(reference) == [0, 1, 2] and all(len(t) == 16 for t in reference.values())
    assert len({tuple(t) for t in reference.values()}) == 3
    eng = engine()
    assert run(eng, [GenerateRequest("s", prompt, SEEDED)])["s"] == reference
    hits = eng.stats().prefix_cache_hit_tokens_total
    assert run(eng, [GenerateRequest("s", prompt, SEEDED)])["s"] == reference  # a cache hit
    assert eng.stats().prefix_cache_hit_tokens_total - hits >= len(prompt) // 16 * 16 - 16
    # choice 0 is the n=1 request with the same seed
    one = run(eng, [GenerateRequest("one", prompt, SamplingParams(temperature=1.0, seed=7,
                                                                  max_tokens=16, ignore_eos=True))])
    assert one["one"][0] == reference[0]


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlapped"])
def test_beside_31_others(prompt: list[int], reference: dict[int, list[int]],
                          overlap: bool) -> None:
    eng = engine(overlap=overlap, max_num_seqs=64)
    others = neighbours(prompt)
    got = run(eng, [*others[:13], GenerateRequest("s", prompt, SEEDED), *others[13:]])
    assert got["s"] == reference


def test_chunked_prefill_and_a_remote_prefill(prompt: list[int],
                                              reference: dict[int, list[int]]) -> None:
    chunked = engine(max_num_batched_tokens=16, long_prefill_token_threshold=16)
    assert run(chunked, [GenerateRequest("s", prompt, SEEDED)])["s"] == reference
    # remote: another engine prefills and samples the first token (as the prefill worker
    # does, n=1, max_tokens=1), this one imports the KV and decodes every choice
    prefill = engine()
    job = GenerateRequest("s", prompt, SamplingParams(temperature=1.0, seed=7, n=1, max_tokens=1,
                                                      ignore_eos=True), export_kv_from_block=0)
    done = [o for o in _drain(prefill, job) if o.finished][0]
    decode = engine()
    request = GenerateRequest("s", prompt, SEEDED)
    assert decode.begin_remote_prefill(request) is not None
    first = decode.complete_remote_prefill("s", done.kv, done.token_ids[0])
    assert first is not None
    assert run(decode, [request], {"s": first})["s"] == reference


def _drain(eng: LLMEngine, request: GenerateRequest) -> list[TokenOutput]:
    eng.add_request(request)
    outs: list[TokenOutput] = []
    while eng.has_unfinished():
        outs += eng.step()
    return outs
