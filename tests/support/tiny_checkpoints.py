"""Tiny random Llama/Qwen2 checkpoints for tests: an HF directory (via transformers) and a
GGUF written from the same weights the way llama.cpp's converter does it.

Dims are multiples of 256 so every GGUF block type (K-quants have 256-wide blocks) fits.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from tests.support.k_quants import quantize_q4_k, quantize_q6_k

Q = GGMLQuantizationType
TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=512,
            rms_norm_eps=1e-6)


def make_hf_model(out_dir: Path, arch: str, tied: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    """Save a random `arch` ("llama" | "qwen2") model to `out_dir`; return its state dict.

    Every parameter (norms and biases included) is random so a misplaced row shows.
    """
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    cfg_cls, model_cls = (LlamaConfig, LlamaForCausalLM) if arch == "llama" else (Qwen2Config, Qwen2ForCausalLM)
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**TINY, tie_word_embeddings=tied, rope_theta=50000.0))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.05)
    model.save_pretrained(out_dir, safe_serialization=True)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if tied:
        state.pop("lm_head.weight", None)
    return state


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf LlamaModel.permute: interleave each head's rotary halves."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}


def _gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{_GGUF_NAMES[rest]}"


def _encode(w: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    if qtype == Q.Q4_K:
        return quantize_q4_k(w)
    if qtype == Q.Q6_K:
        return quantize_q6_k(w)
    return quantize(w, qtype)


def write_gguf(path: Path, arch: str, state: dict[str, torch.Tensor], qtype: GGMLQuantizationType,
               *, context_length: int = 512, rope_theta: float = 50000.0) -> None:
    """Write `state` (HF names) as a GGUF: 2-D weights in `qtype`, 1-D tensors in F32 (as
    llama.cpp does), Llama q/k rows permuted like llama.cpp's converter."""
    n_head, n_kv = TINY["num_attention_heads"], TINY["num_key_value_heads"]
    w = GGUFWriter(str(path), arch)
    w.add_context_length(context_length)
    w.add_embedding_length(TINY["hidden_size"])
    w.add_block_count(TINY["num_hidden_layers"])
    w.add_feed_forward_length(TINY["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base(rope_theta)
    w.add_layer_norm_rms_eps(TINY["rms_norm_eps"])
    w.add_vocab_size(TINY["vocab_size"])
    for name, t in state.items():
        a = t.numpy().astype(np.float32)
        if arch == "llama" and "self_attn.q_proj" in name:
            a = llama_cpp_permute(a, n_head)
        elif arch == "llama" and "self_attn.k_proj" in name:
            a = llama_cpp_permute(a, n_kv)
        if a.ndim == 2 and qtype != Q.F32:
            w.add_tensor(_gguf_name(name), _encode(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(_gguf_name(name), np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
