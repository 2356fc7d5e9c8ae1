"""Quantized weights and multimodal models under tensor parallelism, on tiny models: int8
and int4 sharded per rank equal TP=1's (each rank's slice of the whole weight's
quantization), an int4 cut that would split a group is refused naming the weight, and a
LLaVA model at TP=2 (vision on rank 0, embeddings with the payload) equals transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.api.sampling import SamplingParams
from services.common.config import EngineConfig
from services.engine.batch import ScheduledBatch
from services.engine.engine import LLMEngine
from services.engine.parallel.shard import TpShard
from services.engine.request import GenerateRequest
from services.engine.runner import torch_runner
from services.engine.runner.torch_runner import TorchRunner
from services.engine.sequence import Sequence
from services.engine.tp.runner import TpRunner
from services.engine.weights import load_weights
from tests.support.tiny_model import batch, seq, tiny_hf_model

PROMPT = [5, 17, 99, 3, 42, 8, 61, 77, 23, 1, 64]


def _cfg(**kw) -> EngineConfig:
    base = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=20, tp_timeout_s=120)
    base.update(kw)
    return EngineConfig(**base)


def _tiny(tmp_path: Path) -> Path:
    model, _ = tiny_hf_model("qwen2", tie=False, seed=3)
    model.save_pretrained(tmp_path, safe_serialization=True)
    return tmp_path


def _logits(runner: TorchRunner) -> torch.Tensor:
    """A prefill of 11 tokens, then one decode step: logits (2, V)."""
    runner.request_added(GenerateRequest("a", PROMPT))
    first = runner.logits_for(_owned(batch(seq("a", PROMPT, 0, [0, 1, 2]))))
    nxt = int(first[0].argmax())
    second = runner.logits_for(_owned(batch(seq("a", [nxt], len(PROMPT), [0, 1, 2], num_generated=1))))
    return torch.cat([first, second])


def _owned(b: ScheduledBatch) -> ScheduledBatch:
    """The TP step encoder reads each sequence's prompt length from its owner."""
    b.owners = [Sequence.from_request(GenerateRequest("a", PROMPT))]
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


def test_int4_tp2_runs_each_rank_on_the_cpu_kernels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
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
    # TP=1 prefills on the eager forward as the ranks do (not on the one call, a small
    # prompt's other rounding of which can flip the greedy token the decode step follows)
    monkeypatch.setattr(torch_runner, "ONE_CALL_PREFILL_TOKENS", 0)
    monkeypatch.setattr(torch_runner, "ROWS_PREFILL_SETS", frozenset())
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
                    tp=TpShard(0, 2))


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
        engine.add_request(GenerateRequest("a", full, sp, images=images))
        got: list[int] = []
        while engine.has_unfinished():
            for out in engine.step():
                got.extend(out.token_ids)
    finally:
        runner.close()
    assert got == want
