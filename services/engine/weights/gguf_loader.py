"""Read a Llama/Qwen2 GGUF file into float32 tensors with Hugging Face names.

GGUF stores each 2-D tensor row-major as [out, in] (ggml lists dims innermost-first, so
its `shape` reads [in, out]); dequantizing gives the torch layout directly. llama.cpp's
converter permutes the q/k rows of *Llama* models (LlamaModel.permute: each head's
halves are interleaved for ggml's rotary layout); Qwen2's converter does not, so only
Llama's q/k are un-permuted here.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType

from services.engine.quant.groups import (
    EXACT_TYPES,
    FOUR_BIT_TYPES,
    Int4Groups,
    QuantSource,
    from_gguf_blocks,
)
from services.engine.weights.dequant import dequantize
from services.engine.weights.layout import check_tensors
from services.engine.weights.loaded import LoadedWeights
from services.model.arch import ModelArchConfig
from services.model.errors import UnsupportedModelError
from services.model.gguf_file import open_gguf

SUPPORTED_ARCHS = ("llama", "qwen2")
# Types gguf.quants can dequantize and that we test; others are refused by name rather
# than trusted blindly.
SUPPORTED_TYPES = frozenset(
    GGMLQuantizationType[n]
    for n in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
)
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(.+)")


def hf_name(gguf_name: str) -> str | None:
    """The HF name for a GGUF tensor name, or None when it is not one we map."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}"
    return None


def unpermute_rotary(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Invert llama.cpp's LlamaModel.permute on a q/k weight [n_head*hd, in] or bias [n_head*hd]."""
    rest = w.shape[1:]
    half = w.shape[0] // n_head // 2
    # GGUF rows per head are (half, 2) interleaved; HF rows are (2, half) split halves.
    return w.reshape(n_head, half, 2, *rest).transpose(1, 2).reshape(w.shape).contiguous()




def _f32_to_float(x: float) -> float:
    """GGUF stores floats as f32: 1e-5 reads back as 9.9999997e-06. Take the shortest
    decimal that rounds to the same f32, which is what config.json held."""
    return float(str(np.float32(x)))


def arch_from_metadata(meta: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]],
                       source: Path) -> ModelArchConfig:
    """Build ModelArchConfig from `{arch}.*` keys; `tensor_shapes` is GGUF name -> torch shape."""
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise UnsupportedModelError(
            f"architecture {arch!r} in {source} is not supported; supported: {', '.join(SUPPORTED_ARCHS)}"
        )

    def get(key: str, default: Any = None) -> Any:
        full = f"{arch}.{key}"
        if full not in meta and default is None:
            raise UnsupportedModelError(f"{source}: metadata key {full!r} is missing")
        return meta.get(full, default)

    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None) or "rope_freqs.weight" in tensor_shapes:
        raise UnsupportedModelError(f"{source}: rope scaling ({scaling}) is not supported")
    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    embd = tensor_shapes.get("token_embd.weight")
    if embd is None:
        raise UnsupportedModelError(f"{source}: tensor 'token_embd.weight' is missing")
    return ModelArchConfig(
        architecture=arch,
        vocab_size=int(meta.get(f"{arch}.vocab_size", embd[0])),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("attention.key_length", hidden // heads)),
        rope_theta=_f32_to_float(get("rope.freq_base", 10000.0)),
        rms_norm_eps=_f32_to_float(get("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(get("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_shapes,
        attention_bias="blk.0.attn_q.bias" in tensor_shapes,
    )


def load_gguf(path: Path) -> LoadedWeights:
    """Load every tensor of the GGUF at `path`, dequantized to float32 (see module doc), plus
    the exact int4 groups of its Q4_0 / Q4_1 / Q8_0 weights for a quantized runner."""
    reader = open_gguf(path)
    shapes = {t.name: t.shape for t in reader.tensors}
    arch = arch_from_metadata(reader.metadata, shapes, path)
    tensors: dict[str, torch.Tensor] = {}
    blocks: dict[str, _Blocks] = {}  # Q4_0 / Q4_1 / Q8_0 weights, for their exact int4 form
    four_bit = False
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            raise UnsupportedModelError(f"{path}: tensor {t.name!r} is not part of a {arch.architecture} model")
        if t.tensor_type not in SUPPORTED_TYPES:
            raise UnsupportedModelError(
                f"{path}: tensor {t.name!r} has type {t.tensor_type.name}; supported: "
                f"{', '.join(sorted(q.name for q in SUPPORTED_TYPES))}"
            )
        # np.array copies: F32/F16 come back as views of the read-only memory map.
        arr = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shapes[t.name])
        w = torch.from_numpy(arr)
        if arch.architecture == "llama":
            if ".self_attn.q_proj." in name:
                w = unpermute_rotary(w, arch.num_heads)
            elif ".self_attn.k_proj." in name:
                w = unpermute_rotary(w, arch.num_kv_heads)
        tensors[name] = w
        if t.tensor_type in EXACT_TYPES and len(shapes[t.name]) == 2:
            blocks[name] = (t.data, t.tensor_type, shapes[t.name])  # type: ignore[assignment]
        four_bit |= t.tensor_type in FOUR_BIT_TYPES
    if arch.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
        blocks.pop("lm_head.weight", None)
    check_tensors(arch, tensors, path)
    return LoadedWeights(arch=arch, tensors=tensors, source=path,
                         quant=QuantSource(GgufGroups(blocks, arch), four_bit))


_Blocks = tuple[np.ndarray, GGMLQuantizationType, tuple[int, int]]  # raw bytes, type, torch shape


class GgufGroups(Mapping[str, Int4Groups]):
    """HF name -> the exact int4 groups of a Q4_0 / Q4_1 / Q8_0 weight, rows in HF order.
    Decoded from the file's blocks when asked: a runner without quantization never pays."""

    def __init__(self, blocks: dict[str, _Blocks], arch: ModelArchConfig) -> None:
        self._blocks, self._arch = blocks, arch

    def __getitem__(self, name: str) -> Int4Groups:
        groups = from_gguf_blocks(*self._blocks[name])
        if self._arch.architecture == "llama" and ".self_attn.q_proj." in name:
            return groups.map_rows(lambda w: unpermute_rotary(w, self._arch.num_heads))
        if self._arch.architecture == "llama" and ".self_attn.k_proj." in name:
            return groups.map_rows(lambda w: unpermute_rotary(w, self._arch.num_kv_heads))
        return groups

    def __iter__(self) -> Iterator[str]:
        return iter(self._blocks)

    def __len__(self) -> int:
        return len(self._blocks)
