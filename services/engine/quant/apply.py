"""``engine.quantization``: which mode a runner uses, and swapping a model's linears for it.

``auto`` is int4 for a 4-bit GGUF (Q4_0 / Q4_1 / Q4_K linears) when the activations are
bfloat16 (which ``dtype: auto`` resolves to for such a file; torch's CPU int4 kernel is
slower than a dense GEMM in float32, CUDA's takes only bfloat16), none otherwise; with
tensor parallelism it is none (not measured there: the CPU kernels' one-call decode step,
where int4 pays most on CPU, does not run under TP). Explicit ``int4`` / ``int8`` quantize every linear and the LM head, each rank
its slice under tensor parallelism; the embedding lookup stays dense.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from services.common.config import EngineConfig
from services.engine.cpu_kernels.isa import KernelSet
from services.engine.model import LlamaModel
from services.engine.quant import groups as g
from services.engine.quant import int8_rows
from services.engine.quant.groups import Int4Groups, QuantSource
from services.engine.quant.int8_rows import Int8Rows
from services.engine.quant.linear import Int4Matmul, Int8Matmul, QuantizedLinear
from services.engine.quant.shard import reduces, shard_parts

MODES = ("none", "int8", "int4")
# Which HF weights feed each of a decoder layer's linears, in fused order.
_LAYER_LINEARS = {
    "qkv_proj": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "o_proj": ("self_attn.o_proj.weight",),
    "gate_up_proj": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "down_proj": ("mlp.down_proj.weight",),
}


def resolve_quantization(cfg: EngineConfig, dtype: torch.dtype, source: QuantSource) -> str:
    """``cfg.quantization`` -> none | int8 | int4 (see module doc)."""
    mode = cfg.quantization
    if mode == "auto":
        four_bit = source.four_bit and cfg.tensor_parallel_size == 1
        return "int4" if four_bit and dtype == torch.bfloat16 else "none"
    return mode


@torch.no_grad()
def quantize_model(model: LlamaModel, tensors: Mapping[str, torch.Tensor], source: QuantSource,
                   mode: str, dense_above_rows: int | None, kernels: KernelSet | None = None) -> None:
    """Replace every decoder linear and the LM head of a loaded ``model`` by a
    QuantizedLinear in ``mode`` (int4 | int8). ``tensors`` are the float weights the model
    was loaded from; ``dense_above_rows`` None drops the dense weights, else keeps them for
    batches of more rows (QuantizedLinear). ``kernels``: int4 matmuls on our CPU kernels
    (cpu_kernels/, loaded by the caller) where they take the groups.

    With tensor parallelism each layer keeps its rank's slice (quant/shard.py) of the
    whole weight's quantization: the ranks' partial products sum to the TP=1 matmul's.
    Raises ValueError naming the weight when a rank's input columns would split an int4
    group."""
    if mode not in ("int4", "int8"):
        raise ValueError(f"quantization mode {mode!r} is not int4 | int8")
    dtype, device = model.embed_tokens.weight.dtype, model.embed_tokens.weight.device
    keep_dense = dense_above_rows is not None

    def quantized(names: list[str], layer: nn.Module | None, dense: torch.Tensor, bias: torch.Tensor | None,
                  split: list[int]) -> QuantizedLinear:
        parts = shard_parts(_parts(names, tensors, source, mode), layer, names)
        matmul = _matmul(parts, dtype, device, kernels)
        return QuantizedLinear(matmul, bias, split, dense if keep_dense else None, dense_above_rows or 0,
                               reduce=reduces(layer))

    for i, layer in enumerate(model.layers):
        for attr, parts in _LAYER_LINEARS.items():
            dense_layer = getattr(layer, attr)
            names = [f"model.layers.{i}.{p}" for p in parts]
            split = list(getattr(dense_layer, "shard_sizes", [dense_layer.out_features]))
            setattr(layer, attr, quantized(names, dense_layer, dense_layer.weight, dense_layer.bias, split))
    head = "lm_head.weight" if "lm_head.weight" in tensors else "model.embed_tokens.weight"
    # NOTE: the head is replicated (only rank 0 applies it): the whole weight on every rank.
    model.lm_head = quantized([head], None, model.lm_head_weight, None, [model.arch.vocab_size])


def _parts(names: list[str], tensors: Mapping[str, torch.Tensor], source: QuantSource,
           mode: str) -> list[Int4Groups] | list[Int8Rows]:
    """The whole weight of each name, quantized: exact int4 groups where the file has them
    in one layout, else from the float weights."""
    exact = [source.groups.get(n) for n in names]
    if mode == "int8":
        # Q8_0 already is 8-bit with exact int4-pair groups; other weights go per channel.
        if all(e is not None and e.bits == 8 for e in exact):
            return exact  # type: ignore[return-value]
        return [Int8Rows.from_float(tensors[n]) for n in names]
    if all(e is not None for e in exact) and g.same_layout(exact):  # type: ignore[arg-type]
        return exact  # type: ignore[return-value]
    # Not in the file in one exact layout (HF weights, F16, K-quants, or q/k/v stored in
    # different types): quantize the float weights.
    return [g.from_float(tensors[n]) for n in names]


def _matmul(parts: list[Int4Groups] | list[Int8Rows], dtype: torch.dtype, device: torch.device,
            kernels: KernelSet | None) -> nn.Module:
    if isinstance(parts[0], Int8Rows):
        return Int8Matmul(int8_rows.cat_rows(parts), dtype, device)  # type: ignore[arg-type]
    return Int4Matmul(g.cat_rows(parts), dtype, device, kernels)  # type: ignore[arg-type]
