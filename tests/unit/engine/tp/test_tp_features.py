"""What runs at TP=1 runs under tensor parallelism: the overlapped loop (rank 0's sampled
tokens resolve the placeholders on every rank), n > 1 choices with seeded sampling,
grammar masks beside the overlapped loop, and int8 / int4 weights sharded per rank. One SmolLM2 TP=3 runner serves every engine here
(each rank loads the model: the slow part on two cores)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from services.api.sampling import SamplingParams
from services.common.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.request import GenerateRequest
from services.engine.runner.torch_runner import TorchRunner
from services.engine.tp.runner import TpRunner
from services.engine.weights import LoadedWeights, load_weights
from tests.support.tiny_model import drive_mixed, mixed_workload, tiny_hf_model


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


def _tiny(tmp_path: Path) -> Path:
    model, _ = tiny_hf_model("qwen2", tie=False, seed=3)
    model.save_pretrained(tmp_path, safe_serialization=True)
    return tmp_path


def _logits(runner: TorchRunner) -> torch.Tensor:
    """A prefill of 11 tokens, then one decode step: logits (2, V)."""
    from tests.support.tiny_model import batch, seq

    prompt = [5, 17, 99, 3, 42, 8, 61, 77, 23, 1, 64]
    runner.request_added(GenerateRequest("a", prompt))
    first = runner.logits_for(_owned(batch(seq("a", prompt, 0, [0, 1, 2])), prompt))
    nxt = int(first[0].argmax())
    second = runner.logits_for(_owned(batch(seq("a", [nxt], len(prompt), [0, 1, 2], num_generated=1)), prompt))
    return torch.cat([first, second])


def _owned(b, prompt: list[int]):
    """The TP step encoder reads each sequence's prompt length from its owner."""
    from services.engine.sequence import Sequence

    b.owners = [Sequence.from_request(GenerateRequest("a", prompt))]
    return b


def test_int8_tp2_equals_int8_tp1(tmp_path: Path) -> None:
    path = _tiny(tmp_path)
    lw = load_weights(path)
    kw = dict(quantization="int8", quantized_max_rows=None)
    want = _logits(TorchRunner(lw.arch, lw.tensors, _cfg(**kw)))
    dense = _logits(TorchRunner(lw.arch, lw.tensors, _cfg()))
    runner = TpRunner(lw.arch, lw.tensors, _cfg(tensor_parallel_size=2, **kw), path)
    try:
        assert runner.quantization == "int8"
        got = _logits(runner)
    finally:
        runner.close()
    # test_quant_model.py's int8 tolerance against the dense model holds for both ...
    for q in (want, got):
        rel = (torch.linalg.norm(q - dense) / torch.linalg.norm(dense)).item()
        assert 0 < rel < 0.03, rel
    # ... and each rank's slice of the int8 weights is the TP=1 weights' slice (scales per
    # output row of the whole weight): TP=2 is TP=1 but for the all-reduce's summation order.
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize(("arch", "qtype"), [("llama", "Q8_0"), ("qwen2", "Q4_0")])
def test_int4_tp2_equals_int4_tp1_on_gguf_groups(tmp_path: Path, arch: str, qtype: str) -> None:
    # The file's exact groups, cut per rank: Q8_0's two nibble halves (input_repeat 2) are
    # cut alike; qwen2 adds the q/k/v biases (column-parallel) beside them.
    from gguf import GGMLQuantizationType

    from tests.support.tiny_checkpoints import make_hf_model, write_gguf

    path = tmp_path / "m.gguf"
    write_gguf(path, arch, make_hf_model(tmp_path / "hf", arch, tied=False, seed=3),
               GGMLQuantizationType[qtype])
    lw = load_weights(path)
    kw = dict(quantization="int4", quantized_max_rows=None, cpu_kernels=False)
    want = _logits(TorchRunner(lw.arch, lw.tensors, _cfg(**kw), quant_source=lw.quant))
    runner = TpRunner(lw.arch, lw.tensors, _cfg(tensor_parallel_size=2, **kw), path, quant_source=lw.quant)
    try:
        layer = runner.model.layers[0]
        assert runner.quantization == "int4" and layer.down_proj.reduce and not layer.qkv_proj.reduce
        got = _logits(runner)
    finally:
        runner.close()
    # test_quant_model.py's tolerance for int4 against the file's dequantized model
    assert (got - want).abs().max().item() < 1e-4 * max(1.0, want.abs().max().item())


def test_int4_tp2_runs_each_rank_on_the_cpu_kernels(tmp_path: Path) -> None:
    from gguf import GGMLQuantizationType

    from services.engine.cpu_kernels import build, isa
    from services.engine.cpu_kernels.cpu_features import cpuinfo_flags
    from tests.support.tiny_checkpoints import make_hf_model, write_gguf

    best = isa.resolve("auto", cpuinfo_flags())
    if best == "none" or not build.available(best):
        pytest.skip(f"no CPU int4 kernels here ({best})")
    path = tmp_path / "m.gguf"
    write_gguf(path, "llama", make_hf_model(tmp_path / "hf", "llama", tied=False, seed=3), GGMLQuantizationType.Q4_1)
    lw = load_weights(path)
    kw = dict(dtype="bfloat16", quantization="int4", quantized_max_rows=None, cpu_kernels=True)
    single = TorchRunner(lw.arch, lw.tensors, _cfg(**kw), quant_source=lw.quant)
    assert single.model.cpu_decode is not None
    want = _logits(single)
    runner = TpRunner(lw.arch, lw.tensors, _cfg(tensor_parallel_size=2, **kw), path, quant_source=lw.quant)
    try:
        # each linear on the kernels; the step in torch (the one-call step has no all-reduce)
        assert runner.info.cpu_isa == best and runner.model.cpu_decode is None
        assert runner.model.layers[1].down_proj.matmul.kernels is not None
        got = _logits(runner)
    finally:
        runner.close()
    # test_quant_model.py's tolerance for bfloat16 int4 against float32 (the kernels round
    # each rank's slice of the activations on its own)
    assert (got - want).abs().max().item() < 0.05 * want.abs().max().item()


def test_int4_refuses_a_shard_that_splits_a_group(tmp_path: Path) -> None:
    # The tiny model's MLP is 96 wide: 48 columns a rank is not a whole number of 32-groups.
    path = _tiny(tmp_path)
    lw = load_weights(path)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.down_proj\.weight.*48.*32"):
        TorchRunner(lw.arch, lw.tensors, _cfg(tensor_parallel_size=2, quantization="int4"),
                    tp=_shard(0, 2))


def _shard(rank: int, size: int):
    from services.engine.parallel.shard import TpShard

    return TpShard(rank, size)


def test_llava_tp2_greedy_equals_transformers(tmp_path: Path) -> None:
    # The vision tower runs here (rank 0's process); the embeddings ride with the request's
    # payload to rank 1. Small chunks cut the image across prefill steps; overlapped loop.
    from services.engine.multimodal.vision_tower import ImageEncoder
    from services.engine.multimodal.weights import load_llava_dir
    from services.model.image_spans import expand_placeholders
    from tests.support.tiny_llava import IMAGE_TOKEN, save_tiny_llava, tiny_llava

    hf = tiny_llava("clip", "llama")
    path = save_tiny_llava(hf, tmp_path / "llava")
    w = load_llava_dir(path)
    enc = ImageEncoder(w.arch)
    enc.load_hf_weights(w.vision, w.projector)
    pixels = torch.randn(1, 3, 56, 56, generator=torch.Generator().manual_seed(1))
    full, spans = expand_placeholders([3, 4, 5, IMAGE_TOKEN, 9, 10, 11], IMAGE_TOKEN, w.arch.tokens_per_image,
                                      ["a" * 64])
    with torch.no_grad():
        images = tuple(s.with_embeds(enc(pixels)[0]) for s in spans)
        want = hf.generate(input_ids=torch.tensor([full]), pixel_values=pixels, max_new_tokens=6,
                           do_sample=False)[0, len(full):].tolist()
    cfg = _cfg(tensor_parallel_size=2, num_kv_blocks=64, max_num_batched_tokens=8, overlap=True)
    runner = TpRunner(w.text.arch, w.text.tensors, cfg, path)
    try:
        engine = LLMEngine(runner, cfg, eos_token_ids=[])
        sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        got = _choices(engine, [GenerateRequest("a", full, sp, images=images)])
    finally:
        runner.close()
    assert got == {("a", 0): want}
