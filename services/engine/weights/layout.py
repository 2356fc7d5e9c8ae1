"""The tensor names and shapes a Llama-family model must have, in Hugging Face naming.

Both loaders check their result against `expected_shapes`, so a runner can index the
dict without guarding against missing or misshapen tensors.
"""

from __future__ import annotations

from pathlib import Path

import torch

from services.model.arch import ModelArchConfig
from services.model.errors import UnsupportedModelError


def expected_shapes(arch: ModelArchConfig) -> dict[str, tuple[int, ...]]:
    """HF name -> shape for every tensor of `arch` (linear weights are [out, in])."""
    h, hd = arch.hidden_size, arch.head_dim
    q_out, kv_out = arch.num_heads * hd, arch.num_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (arch.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (arch.vocab_size, h)
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q_out, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv_out, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv_out, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q_out)
        if arch.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q_out,)
            shapes[p + "self_attn.k_proj.bias"] = (kv_out,)
            shapes[p + "self_attn.v_proj.bias"] = (kv_out,)
        shapes[p + "mlp.gate_proj.weight"] = (arch.intermediate_size, h)
        shapes[p + "mlp.up_proj.weight"] = (arch.intermediate_size, h)
        shapes[p + "mlp.down_proj.weight"] = (h, arch.intermediate_size)
    return shapes


def check_tensors(arch: ModelArchConfig, tensors: dict[str, torch.Tensor], source: Path) -> None:
    """Raise UnsupportedModelError unless `tensors` holds exactly the expected names/shapes."""
    want = expected_shapes(arch)
    missing = sorted(want.keys() - tensors.keys())
    extra = sorted(tensors.keys() - want.keys())
    if missing or extra:
        raise UnsupportedModelError(
            f"{source}: tensors do not match a {arch.architecture} model "
            f"(missing: {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected: {extra[:5]}{'...' if len(extra) > 5 else ''})"
        )
    for name, shape in want.items():
        if tuple(tensors[name].shape) != shape:
            raise UnsupportedModelError(
                f"{source}: tensor {name} has shape {tuple(tensors[name].shape)}, expected {shape}"
            )
