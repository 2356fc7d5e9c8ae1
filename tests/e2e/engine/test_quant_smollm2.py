"""The fast paths on the real SmolLM2 (Q4_1 GGUF) against our float32 unquantized engine:
bfloat16, int4 (repacked from the file's Q4_1 blocks) and int8 keep the greedy output of 20
prompts for at least the first 16 tokens on most prompts, and the perplexity of a fixed text
(tests/data/gettysburg.txt) within 2%.

Every linear runs on the quantized kernels here (engine.quantized_max_rows: null), prefill
included, so the numbers are the kernels', not the dense copy's."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from services.api.sampling import SamplingParams
from services.common.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.request import GenerateRequest
from services.engine.runner.step_inputs import build_step_inputs
from services.engine.runner.torch_runner import TorchRunner
from services.engine.weights import LoadedWeights, load_weights
from tests.support.tiny_model import batch, seq

TEXT = Path(__file__).resolve().parents[2] / "data" / "gettysburg.txt"
TOKENS = 16
PROMPTS = [
    "What is the capital of France?", "Name three primary colours.", "How many legs does a spider have?",
    "Write a haiku about the sea.", "What is 12 times 12?", "Who wrote Romeo and Juliet?",
    "Explain photosynthesis in one sentence.", "What is the boiling point of water?",
    "Give me a synonym for happy.", "What does a CPU do?", "List the planets of the solar system.",
    "Why is the sky blue?", "Translate 'good morning' into Spanish.", "What is the largest ocean?",
    "Suggest a name for a pet cat.", "How do I make a cup of tea?", "What is gravity?",
    "Tell me a fun fact about octopuses.", "What is the square root of 81?", "Describe a rainbow.",
]
# (dtype, quantization) -> at least this many of the 20 prompts keep their first 16 tokens.
# Measured here (AVX512-BF16 CPU): bfloat16 14, int4 16 (on our CPU kernels; 14 on torch's),
# int8 9. On an AVX2-only CPU int4 keeps 16 with the eager prefill and 11 with the prefill
# as rows (engine.cpu_prefill auto there), whose float32 residual stream puts its logits
# closer to float32's (over the text below: KL 0.0080 against 0.0107, mean |logit error|
# 0.20 against 0.25, perplexity +0.7% against +0.1%) yet parts from them at other near-ties
# (2026-11-29). A 135M model has many
# near-ties, and greedy decoding turns the first flipped one into a different text: any
# perturbation of the weights' or activations' rounding (bfloat16 alone) flips some. int8
# re-rounds the file's 4-bit weights to one scale a row, the largest perturbation; its
# perplexity is still the closest of the three.
FAST_PATHS = {
    "bfloat16": (("bfloat16", "none"), 12),
    "int4": (("bfloat16", "int4"), 10),
    "int8": (("bfloat16", "int8"), 7),
}


@pytest.fixture(scope="module")
def weights(smollm2_path: Path) -> LoadedWeights:
    return load_weights(smollm2_path)


def _runner(weights: LoadedWeights, dtype: str, quantization: str) -> TorchRunner:
    cfg = EngineConfig(device="cpu", dtype=dtype, quantization=quantization, quantized_max_rows=None,
                       block_size=16, num_kv_blocks=96, max_num_seqs=len(PROMPTS), max_num_batched_tokens=1024)
    return TorchRunner(weights.arch, weights.tensors, cfg, quant_source=weights.quant)


def _greedy(runner: TorchRunner, prompts: list[list[int]]) -> list[list[int]]:
    engine = LLMEngine(runner, EngineConfig(block_size=16, num_kv_blocks=96, max_num_seqs=len(PROMPTS),
                                            max_num_batched_tokens=1024), eos_token_ids=[])
    sp = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(GenerateRequest(str(i), p, sp))
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].extend(o.token_ids)
    engine.check_integrity()
    return [out[str(i)] for i in range(len(prompts))]


def _perplexity(runner: TorchRunner, ids: list[int]) -> float:
    """exp(mean next-token NLL) of ``ids`` in one forward over the whole text, on the path the
    runner's prefill takes (rows on the CPU kernels' one call where engine.cpu_prefill says so)."""
    blocks = list(range(math.ceil(len(ids) / runner.block_size)))
    step = build_step_inputs(batch(seq("ppl", ids, 0, blocks)), runner.block_size, runner.device, runner.dtype,
                             per_token=runner.prefill_rows)
    with torch.inference_mode():
        hidden = runner.model(step.input_ids, step.positions, step.meta, runner.kv_cache)  # (T, H)
        logits = runner.model.compute_logits(hidden[:-1]).float()  # (T-1, V)
        nll = F.cross_entropy(logits, torch.tensor(ids[1:]))
    return math.exp(nll.item())


@pytest.fixture(scope="module")
def inputs(smollm2_tokenizer) -> tuple[list[list[int]], list[int]]:
    prompts = [smollm2_tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    return prompts, smollm2_tokenizer.encode(TEXT.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def reference(weights, inputs) -> tuple[list[list[int]], float]:
    prompts, text = inputs
    runner = _runner(weights, "float32", "none")
    return _greedy(runner, prompts), _perplexity(runner, text)


@pytest.mark.parametrize("path", list(FAST_PATHS))
def test_fast_path_keeps_greedy_output_and_perplexity(path, weights, inputs, reference, record_property) -> None:
    (dtype, quantization), min_matching = FAST_PATHS[path]
    prompts, text = inputs
    want_tokens, want_ppl = reference
    runner = _runner(weights, dtype, quantization)
    assert runner.quantization == quantization and runner.dtype == getattr(torch, dtype)
    got = _greedy(runner, prompts)
    matching = sum(g[:TOKENS] == w[:TOKENS] for g, w in zip(got, want_tokens, strict=True))
    first = sum(g[0] == w[0] for g, w in zip(got, want_tokens, strict=True))
    ppl = _perplexity(runner, text)
    record_property("matching_prompts", matching)
    record_property("perplexity", (ppl, want_ppl))
    print(f"{path}: {matching}/{len(PROMPTS)} prompts keep {TOKENS} tokens, {first} the first; "
          f"perplexity {ppl:.3f} vs float32 {want_ppl:.3f}")
    assert len(text) > 300 and 1 < want_ppl < 100  # a real text the model reads well
    assert first >= len(PROMPTS) - 2, f"{first}/{len(PROMPTS)} prompts start with float32's token"
    assert matching >= min_matching, f"{matching}/{len(PROMPTS)} prompts match float32 for {TOKENS} tokens"
    assert abs(ppl / want_ppl - 1) <= 0.02, (ppl, want_ppl)
