"""The quantized model end to end on tiny GGUF / HF checkpoints: int4 repacked from Q4_0 / Q4_1
/ Q8_0 blocks computes the very model the file's dequantized weights describe (float32
activations: equal within accumulation-order noise), rotary rows and biases included; int4
and int8 from float weights stay close to the dense model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType

from services.common.config import EngineConfig
from services.engine.quant.linear import Int4Matmul, Int8Matmul, QuantizedLinear
from services.engine.runner.torch_runner import TorchRunner
from services.engine.weights import LoadedWeights, load_weights
from tests.support.tiny_checkpoints import make_hf_model, write_gguf
from tests.support.tiny_model import batch, seq

Q = GGMLQuantizationType
PROMPT = [5, 17, 99, 3, 42, 8, 61, 77, 23, 1, 64, 2]


def _runner(lw: LoadedWeights, **cfg) -> TorchRunner:
    return TorchRunner(lw.arch, lw.tensors, EngineConfig(device="cpu", block_size=4, num_kv_blocks=32, **cfg),
                       quant_source=lw.quant)


def _prefill_then_decode(r: TorchRunner) -> torch.Tensor:
    """Logits (2, V): after the prompt (one prefill), then after one decode step."""
    first = r.logits_for(batch(seq("a", PROMPT, 0, [0, 1, 2, 3])))
    nxt = int(first[0].argmax())
    second = r.logits_for(batch(seq("a", [nxt], len(PROMPT), [0, 1, 2, 3], num_generated=1)))
    return torch.cat([first, second])


@pytest.fixture(scope="module", params=[("llama", False, Q.Q4_1), ("qwen2", True, Q.Q4_0), ("llama", True, Q.Q8_0)],
                ids=lambda p: f"{p[0]}-{'tied' if p[1] else 'untied'}-{p[2].name}")
def gguf_weights(request, tmp_path_factory) -> LoadedWeights:
    arch, tied, qtype = request.param
    d = tmp_path_factory.mktemp(f"{arch}{int(tied)}{qtype.name}")
    write_gguf(d / "m.gguf", arch, make_hf_model(d / "hf", arch, tied, seed=3), qtype)
    return load_weights(d / "m.gguf")


def test_int4_from_gguf_blocks_is_the_files_model(gguf_weights: LoadedWeights) -> None:
    lw = gguf_weights
    assert lw.quant.four_bit == (next(iter(lw.quant.groups.values())).bits == 4)
    dense = _runner(lw, dtype="float32", quantization="none")
    # torch's int4 kernel, exact in float32 (our CPU kernels round the activations to int8:
    # test_cpu_kernels.py holds them to that rounding)
    quant = _runner(lw, dtype="float32", quantization="int4", quantized_max_rows=None, cpu_kernels=False)
    assert quant.quantization == "int4" and dense.quantization == "none"
    layer = quant.model.layers[0]
    for linear in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj, quant.model.lm_head):
        assert isinstance(linear, QuantizedLinear) and isinstance(linear.matmul, Int4Matmul)
        assert linear.dense is None  # quantized_max_rows=None: the int4 kernels at every size
    want = _prefill_then_decode(dense)
    got = _prefill_then_decode(quant)
    assert (got - want).abs().max().item() < 1e-4 * max(1.0, want.abs().max().item())


def test_auto_quantizes_a_4_bit_gguf_only_with_16_bit_activations(gguf_weights: LoadedWeights) -> None:
    lw = gguf_weights
    bf16 = _runner(lw, dtype="bfloat16", quantization="auto")
    assert bf16.quantization == ("int4" if lw.quant.four_bit else "none")
    assert _runner(lw, dtype="float32", quantization="auto").quantization == "none"
    if lw.quant.four_bit:
        # The default keeps a dense copy for prefill-sized batches: both paths agree closely.
        want = _prefill_then_decode(_runner(lw, dtype="float32", quantization="none"))
        got = _prefill_then_decode(bf16)
        assert (got - want).abs().max().item() < 0.05 * want.abs().max().item()


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_hf_weights_quantize_from_float(tmp_path: Path, mode: str) -> None:
    make_hf_model(tmp_path, "qwen2", tied=False, seed=4)
    lw = load_weights(tmp_path)
    assert not lw.quant.groups and not lw.quant.four_bit
    dense = _runner(lw, dtype="float32", quantization="none")
    quant = _runner(lw, dtype="float32", quantization=mode, quantized_max_rows=None)
    kernel = Int4Matmul if mode == "int4" else Int8Matmul
    assert isinstance(quant.model.layers[1].gate_up_proj.matmul, kernel)
    assert isinstance(quant.model.lm_head.matmul, kernel)
    want, got = _prefill_then_decode(dense), _prefill_then_decode(quant)
    rel = (torch.linalg.norm(got - want) / torch.linalg.norm(want)).item()
    # int4 (16 levels a group of 32) and int8 (255 a row) noise on Gaussian weights; a wrong
    # row or group would be ~1.
    assert 0 < rel < (0.25 if mode == "int4" else 0.03), rel
