"""Weight-only quantization pieces: GGUF Q4_0 / Q4_1 / Q8_0 blocks repacked into torch's int4
kernels reproduce the file's dequantized weights exactly (within the scale dtype's rounding),
float weights quantize within their step, and `engine.quantization` resolves as documented."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from services.common.config import EngineConfig
from services.engine.quant import groups as g
from services.engine.quant.apply import resolve_quantization
from services.engine.quant.int8_rows import Int8Rows
from services.engine.quant.linear import Int4Matmul, Int8Matmul, QuantizedLinear

Q = GGMLQuantizationType
CPU = torch.device("cpu")
DEVICES = [CPU] + ([torch.device("cuda")] if torch.cuda.is_available() else [])


def _gguf_tensor(qtype: GGMLQuantizationType, shape: tuple[int, int], seed: int = 0):
    """Random weights with a per-row offset (so Q4_1's minimum matters) as GGUF blocks, and
    what gguf-py dequantizes them to."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal(shape) + rng.standard_normal((shape[0], 1))).astype(np.float32)
    raw = quantize(w, qtype)
    return raw, torch.from_numpy(np.array(dequantize(raw, qtype), dtype=np.float32).reshape(shape))


def _weight_through_kernel(m: torch.nn.Module, k: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """W (out, in) as the kernel computes it: the matmul of the identity."""
    return m(torch.eye(k, dtype=dtype, device=device)).float().cpu().T


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=lambda q: q.name)
def test_gguf_blocks_repack_exactly_in_float32(qtype: GGMLQuantizationType) -> None:
    raw, want = _gguf_tensor(qtype, (48, 96))
    groups = g.from_gguf_blocks(raw, qtype, (48, 96))
    assert groups.bits == (8 if qtype == Q.Q8_0 else 4)
    # The groups themselves, and the CPU kernel over them, give back the file's weights;
    # the only freedom is float32 rounding of `d * (q - 8) + (m + 8d)` against `d * q + m`.
    tol = 4 * torch.finfo(torch.float32).eps * want.abs().max()
    assert (groups.dequantize() - want).abs().max() <= tol
    got = _weight_through_kernel(Int4Matmul(groups, torch.float32, CPU), 96, torch.float32, CPU)
    assert (got - want).abs().max() <= tol


@pytest.mark.parametrize("device", DEVICES, ids=str)
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=lambda q: q.name)
def test_gguf_blocks_in_bfloat16_differ_only_by_the_scales_rounding(qtype, device) -> None:
    raw, want = _gguf_tensor(qtype, (64, 128), seed=1)
    groups = g.from_gguf_blocks(raw, qtype, (64, 128))
    got = _weight_through_kernel(Int4Matmul(groups, torch.bfloat16, device), 128, torch.bfloat16, device)
    # bfloat16 keeps 8 significant bits: scale and zero each move by <= 2^-9 relative, the
    # output by one more rounding.
    per_row = want.abs().amax(dim=1, keepdim=True)
    assert ((got - want).abs() <= per_row * 2**-6).all()
    if qtype != Q.Q8_0:  # and a misplaced nibble would be off by a whole step (d)
        d = raw.view(np.uint8).reshape(64, 4, -1)[..., :2].copy().view(np.float16).astype(np.float32)
        assert (got - want).abs().max() < float(np.abs(d).min())


def test_q8_0_splits_into_two_nibbles_over_a_repeated_input() -> None:
    raw, want = _gguf_tensor(Q.Q8_0, (8, 64), seed=2)
    groups = g.from_gguf_blocks(raw, Q.Q8_0, (8, 64))
    assert groups.input_repeat == 2 and tuple(groups.codes.shape) == (8, 128)
    assert int(groups.codes.max()) <= 15 and groups.in_features == 64
    x = torch.randn(3, 64)
    assert torch.allclose(Int4Matmul(groups, torch.float32, CPU)(x), x @ want.T, atol=1e-4, rtol=1e-5)


def test_real_smollm2_q4_1_tensor_repacks_exactly(smollm2_path) -> None:
    from services.model.gguf_file import open_gguf

    t = next(t for t in open_gguf(smollm2_path).tensors if t.name == "blk.0.attn_k.weight")
    assert t.tensor_type == Q.Q4_1  # what the default model's linears are stored in
    shape = t.shape
    want = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape))
    groups = g.from_gguf_blocks(t.data, t.tensor_type, shape)
    got = _weight_through_kernel(Int4Matmul(groups, torch.float32, CPU), shape[1], torch.float32, CPU)
    assert (got - want).abs().max() <= 4 * torch.finfo(torch.float32).eps * want.abs().max()


def test_fused_rows_and_row_permutation_follow_the_weights() -> None:
    raws = [_gguf_tensor(Q.Q4_1, (32, 64), seed=s) for s in (3, 4)]
    parts = [g.from_gguf_blocks(r, Q.Q4_1, (32, 64)) for r, _ in raws]
    fused = g.cat_rows(parts)
    assert torch.equal(fused.dequantize(), torch.cat([w for _, w in raws]))
    flipped = parts[0].map_rows(lambda t: t.flip(0))
    assert torch.equal(flipped.dequantize(), parts[0].dequantize().flip(0))
    with pytest.raises(ValueError, match="layouts"):
        g.cat_rows([parts[0], g.from_gguf_blocks(_gguf_tensor(Q.Q8_0, (32, 64))[0], Q.Q8_0, (32, 64))])


def test_float_weights_quantize_within_half_a_step() -> None:
    w = torch.randn(40, 96) * 0.1 + torch.randn(40, 1)
    groups = g.from_float(w, 32)
    step = (w.view(40, 3, 32).amax(-1) - w.view(40, 3, 32).amin(-1)) / 15  # (N, G)
    err = (groups.dequantize() - w).abs().view(40, 3, 32)
    assert (err <= step.unsqueeze(-1) / 2 + 1e-6).all()
    with pytest.raises(ValueError, match="group size"):
        g.from_float(torch.randn(4, 48), 32)


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_int8_per_channel_within_half_a_step(device) -> None:
    w = torch.randn(64, 96)
    m = Int8Matmul(Int8Rows.from_float(w), torch.float32 if device.type == "cpu" else torch.bfloat16, device)
    dtype = m.scale.dtype
    got = _weight_through_kernel(m, 96, dtype, device)
    step = w.abs().amax(dim=1, keepdim=True) / 127
    slack = 0 if dtype == torch.float32 else w.abs().amax(dim=1, keepdim=True) * 2**-7
    assert ((got - w).abs() <= step / 2 + slack + 1e-6).all()


def test_quantized_linear_switches_to_dense_above_the_row_limit() -> None:
    raw, w = _gguf_tensor(Q.Q4_1, (24, 64), seed=5)
    matmul = Int4Matmul(g.from_gguf_blocks(raw, Q.Q4_1, (24, 64)), torch.float32, CPU)
    bias = torch.randn(24)
    wrong_dense = torch.zeros(24, 64)  # tells the two paths apart
    layer = QuantizedLinear(matmul, bias, [16, 8], wrong_dense, dense_above_rows=2)
    x = torch.randn(2, 64)
    assert torch.allclose(layer(x), x @ w.T + bias, atol=1e-4)
    assert torch.equal(layer(torch.randn(3, 64)), bias.expand(3, 24))
    assert [t.shape[-1] for t in layer.split_output(layer(x))] == [16, 8]


@pytest.mark.parametrize(("mode", "dtype", "four_bit", "want"), [
    ("auto", torch.bfloat16, True, "int4"),
    ("auto", torch.bfloat16, False, "none"),  # an F16 / Q8_0 / HF model stays dense
    ("auto", torch.float32, True, "none"),  # the CPU int4 kernel loses to float32 GEMM
    ("auto", torch.float16, True, "none"),  # CUDA's int4 kernel takes bfloat16 only
    ("int8", torch.float32, False, "int8"),
    ("none", torch.bfloat16, True, "none"),
])
def test_resolve_quantization(mode, dtype, four_bit, want) -> None:
    cfg = EngineConfig(quantization=mode)
    assert resolve_quantization(cfg, dtype, g.QuantSource({}, four_bit)) == want


def test_quantization_with_tensor_parallelism() -> None:
    source = g.QuantSource({}, True)
    # auto stays dense under TP (the CPU kernels' one-call decode step does not run there)
    cfg = EngineConfig(tensor_parallel_size=3, quantization="auto")
    assert resolve_quantization(cfg, torch.bfloat16, source) == "none"
    for mode in ("int4", "int8"):  # each rank quantizes its slice (tp/test_tp_weights_images.py)
        cfg = EngineConfig(tensor_parallel_size=3, quantization=mode)
        assert resolve_quantization(cfg, torch.bfloat16, source) == mode
