"""What runs at TP=1 runs under tensor parallelism, on the real model: the overlapped loop
(rank 0's sampled tokens resolve the placeholders on every rank), n > 1 choices with
seeded sampling, and grammar masks beside the overlapped loop. One SmolLM2 TP=3 runner
serves every engine here (each rank loads the model: the slow part on two cores);
test_tp_weights_images.py has quantized weights and LLaVA."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.api.sampling import SamplingParams
from services.common.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.request import GenerateRequest
from services.engine.runner.torch_runner import TorchRunner
from services.engine.tp.runner import TpRunner
from services.engine.weights import LoadedWeights, load_weights
from tests.support.tiny_model import drive_mixed, mixed_workload


def _cfg(**kw) -> EngineConfig:
    base = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=20, max_num_seqs=6,
                max_num_batched_tokens=12, tp_timeout_s=120)
    base.update(kw)
    return EngineConfig(**base)


@pytest.fixture(scope="module")
def smollm2(smollm2_path: Path) -> LoadedWeights:
    return load_weights(smollm2_path)


@pytest.fixture(scope="module")
def tp3(smollm2_path: Path, smollm2: LoadedWeights) -> Iterator[TpRunner]:
    runner = TpRunner(smollm2.arch, smollm2.tensors, _cfg(tensor_parallel_size=3), smollm2_path)
    try:
        yield runner
    finally:
        runner.close()


def test_smollm2_tp3_overlap_equals_serial(tp3: TpRunner, smollm2: LoadedWeights) -> None:
    # Chunked prefill, prefix hits, preemption and aborts (a pool far below the demand),
    # the same runner behind both loops.
    vocab = smollm2.arch.vocab_size
    got = {}
    for overlap in (False, True):
        engine = LLMEngine(tp3, _cfg(tensor_parallel_size=3, overlap=overlap), eos_token_ids=[0])
        assert engine.overlap is overlap
        got[overlap] = drive_mixed(engine, mixed_workload(vocab))
        stats = engine.stats()
        assert stats.num_preemptions_total > 0 and stats.prefix_cache_hit_tokens_total > 0
        assert stats.kv_blocks_used == 0
    assert tp3._handles == {}, "every finished or aborted request is forgotten"
    assert got[True] == got[False]
    assert sum(len(t) for t in got[True][0].values()) > 50


def _choices(engine: LLMEngine, reqs: list[GenerateRequest]) -> dict[tuple[str, int], list[int]]:
    got: dict[tuple[str, int], list[int]] = {}
    for r in reqs:
        engine.add_request(r)
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            got.setdefault((out.request_id, out.index), []).extend(out.token_ids)
        steps += 1
        assert steps < 500, "engine did not drain"
    return got


def _n3_requests() -> list[GenerateRequest]:
    sp = SamplingParams(temperature=0.8, top_p=0.95, n=3, seed=11, max_tokens=10, ignore_eos=True)
    greedy = SamplingParams(temperature=0, n=2, max_tokens=6, ignore_eos=True)
    return [GenerateRequest("s", [1, 504, 3157, 314, 260, 3241, 282, 4649, 30], sp),
            GenerateRequest("g", [1, 9690, 17, 1187, 359, 346, 47], greedy)]


def test_smollm2_tp3_n3_seeded_equals_unsplit(tp3: TpRunner, smollm2: LoadedWeights) -> None:
    cfg1 = _cfg()
    want = _choices(LLMEngine(TorchRunner(smollm2.arch, smollm2.tensors, cfg1), cfg1, eos_token_ids=[0]),
                    _n3_requests())
    assert sorted(want) == [("g", 0), ("g", 1), ("s", 0), ("s", 1), ("s", 2)]
    assert len({tuple(want["s", i]) for i in range(3)}) == 3, "seeded choices draw apart"
    for overlap in (False, True):
        cfg = _cfg(tensor_parallel_size=3, overlap=overlap)
        engine = LLMEngine(tp3, cfg, eos_token_ids=[0])
        assert _choices(engine, _n3_requests()) == want, f"overlap={overlap}"
        assert engine.stats().kv_blocks_used == 0
    assert tp3._handles == {}


def test_smollm2_tp3_grammar_overlapped_equals_unsplit(tp3: TpRunner, smollm2: LoadedWeights,
                                                      smollm2_tokenizer) -> None:
    # The mask is built on rank 0's scheduler thread and applied by its sampler; overlapped,
    # batch N+1's sampler waits for it while the ranks already run N+1's forward.
    from services.api.structured import StructuredKind, StructuredOutput
    from services.engine.grammar.compiler import GrammarCompiler

    tok = smollm2_tokenizer
    regex = r"[0-9]{3}-[a-z]{2}"

    def reqs() -> list[GenerateRequest]:
        def sp(structured: StructuredOutput | None) -> SamplingParams:
            return SamplingParams(temperature=0, max_tokens=12, structured=structured)

        return [GenerateRequest("regex", tok.encode("Give me a code:"), sp(StructuredOutput(StructuredKind.REGEX, regex))),
                GenerateRequest("choice", tok.encode("Is the sky blue?"),
                                sp(StructuredOutput(StructuredKind.CHOICE, choices=("yes", "no", "maybe so")))),
                GenerateRequest("free", tok.encode("The sky is"), sp(None))]

    def engine(runner: TorchRunner, cfg: EngineConfig) -> LLMEngine:
        grammar = GrammarCompiler(tok.to_json(), runner.vocab_size, tok.stop_token_ids)
        return LLMEngine(runner, cfg, tok.stop_token_ids, grammar=grammar)

    cfg1 = _cfg()
    want = _choices(engine(TorchRunner(smollm2.arch, smollm2.tensors, cfg1), cfg1), reqs())
    assert re.fullmatch(regex, tok.decode(want["regex", 0]))
    assert tok.decode(want["choice", 0]) in ("yes", "no", "maybe so")
    got = _choices(engine(tp3, _cfg(tensor_parallel_size=3, overlap=True)), reqs())
    assert got == want
