"""The Llama-family decoder (Llama, SmolLM2, Qwen2) over a paged KV cache.

Weights come from a Hugging Face-named state dict (``load_hf_weights``); q/k/v and
gate/up are fused into one matmul each. With tensor parallelism, attention heads and the
MLP's intermediate dimension are split across ranks (KV heads replicated where there are
more ranks than KV heads, parallel/shard.py); the embedding, norms and LM head are replicated,
and only the entry rank applies the head (docs/engine.md, "Tensor parallelism").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.engine.layers.attention import AttentionMetadata, paged_attention
from services.engine.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from services.engine.layers.norm import RMSNorm
from services.engine.layers.rotary import RotaryEmbedding, apply_rotary
from services.engine.parallel.shard import TpShard, check_tp_layout
from services.engine.runner.cpu_decode import CpuDecode
from services.model.arch import ModelArchConfig


class DecoderLayer(nn.Module):
    def __init__(
        self, arch: ModelArchConfig, dtype: torch.dtype, device: torch.device, tp_rank: int, tp_size: int
    ) -> None:
        super().__init__()
        tp = {"tp_rank": tp_rank, "tp_size": tp_size, "dtype": dtype, "device": device}
        h, hd = arch.hidden_size, arch.head_dim
        check_tp_layout(arch, tp_size)
        shard = TpShard(tp_rank, tp_size)
        kv_reps = shard.kv_replicas(arch.num_kv_heads)
        self.num_heads = arch.num_heads // tp_size
        self.num_kv_heads = shard.local_kv_heads(arch.num_kv_heads)
        self.head_dim = hd
        self.input_layernorm = RMSNorm(h, arch.rms_norm_eps, dtype, device)
        self.qkv_proj = MergedColumnParallelLinear(
            h, [arch.num_heads * hd, arch.num_kv_heads * hd, arch.num_kv_heads * hd], bias=arch.attention_bias,
            replicas=[1, kv_reps, kv_reps], **tp
        )
        self.o_proj = RowParallelLinear(arch.num_heads * hd, h, **tp)
        self.post_attention_layernorm = RMSNorm(h, arch.rms_norm_eps, dtype, device)
        self.gate_up_proj = MergedColumnParallelLinear(h, [arch.intermediate_size] * 2, **tp)
        self.down_proj = RowParallelLinear(arch.intermediate_size, h, **tp)
        # paged_attention's contract; engine.deterministic on CUDA swaps in its own (layers/invariant.py)
        self.attend = paged_attention

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        t = x.shape[0]
        x, residual = self.input_layernorm(x, residual)  # (T, H)
        qkv = self.qkv_proj(x).view(t, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        # q and k sit side by side in the fused output: rotate them in one pass.
        qk = apply_rotary(qkv[:, : self.num_heads + self.num_kv_heads], cos, sin)  # (T, Hq+Hkv, hd)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)  # (T, Hq, hd), (T, Hkv, hd)
        v = qkv[:, self.num_heads + self.num_kv_heads :]  # (T, Hkv, hd)
        attn = self.attend(q, k, v, kv_cache, meta)  # (T, Hq, hd)
        x = self.o_proj(attn.reshape(t, self.num_heads * self.head_dim))
        x, residual = self.post_attention_layernorm(x, residual)
        gate, up = self.gate_up_proj.split_output(self.gate_up_proj(x))
        return self.down_proj(F.silu(gate) * up), residual


class LlamaModel(nn.Module):
    """``forward`` maps new tokens to final hidden states; ``compute_logits`` applies the LM head.

    The KV cache passed to ``forward`` is ``(num_layers, 2, num_blocks, block_size,
    local KV heads, head_dim)``, owned by the runner (``TpShard.local_kv_heads``).
    """

    def __init__(
        self,
        arch: ModelArchConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        tp_rank: int = 0,
        tp_size: int = 1,
        max_len: int | None = None,
    ) -> None:
        super().__init__()
        if arch.architecture not in ("llama", "qwen2"):
            raise ValueError(f"unsupported architecture {arch.architecture!r} (llama | qwen2)")
        device = torch.device(device)
        self.arch = arch
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size, dtype=dtype, device=device)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(
            DecoderLayer(arch, dtype, device, tp_rank, tp_size) for _ in range(arch.num_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype, device)
        self.lm_head_weight = (
            self.embed_tokens.weight
            if arch.tie_word_embeddings
            else nn.Parameter(
                torch.empty(arch.vocab_size, arch.hidden_size, dtype=dtype, device=device),
                requires_grad=False,
            )
        )
        # Set by quant.apply.quantize_model: a quantized head used instead of lm_head_weight.
        self.lm_head: nn.Module | None = None
        # Set by the runner where every layer runs on our CPU int4 kernels: decode-only
        # steps go through runner/cpu_decode.py in one call.
        self.cpu_decode: CpuDecode | None = None
        self.rotary = RotaryEmbedding(
            arch.head_dim, max_len or arch.max_position_embeddings, arch.rope_theta, dtype, device
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor | list[torch.Tensor],
        mm_rows: torch.Tensor | None = None,
        mm_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions (T,) -> hidden (T, H).

        ``kv_cache`` is the 6-D cache or, to skip re-slicing it every step, its per-layer
        views ``list(kv_cache)``. ``mm_embeds`` (M, H) replace the token embeddings of rows
        ``mm_rows`` (M,): a multimodal model's image placeholders.
        """
        if self.cpu_decode is not None and self.cpu_decode.takes(meta, mm_rows):
            return self.cpu_decode(input_ids, positions, meta, list(kv_cache))
        cos, sin = self.rotary.lookup(positions)  # (T, 1, hd) each, shared by all layers
        x = self.embed_tokens(input_ids)  # (T, H)
        if mm_rows is not None:
            x[mm_rows] = mm_embeds
        residual = None
        for layer, layer_cache in zip(self.layers, kv_cache, strict=True):
            x, residual = layer(x, residual, cos, sin, meta, layer_cache)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (N, H) -> logits (N, V). Pass only the rows that will be sampled."""
        if self.lm_head is not None:
            return self.lm_head(hidden)
        return F.linear(hidden, self.lm_head_weight)

    @torch.no_grad()
    def load_hf_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load a Hugging Face-named state dict; every tensor must be used exactly once.

        Raises ValueError naming the first missing, unexpected or mis-shaped tensor.
        """
        remaining = dict(tensors)

        def take(name: str) -> torch.Tensor:
            if name not in remaining:
                raise ValueError(f"missing tensor {name!r}")
            return remaining.pop(name)

        def take_bias(name: str, wanted: bool) -> torch.Tensor | None:
            return take(name) if wanted else None

        _copy(self.embed_tokens.weight, take("model.embed_tokens.weight"), "model.embed_tokens.weight")
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            _copy(layer.input_layernorm.weight, take(p + "input_layernorm.weight"), p + "input_layernorm.weight")
            for part, name in enumerate(("q_proj", "k_proj", "v_proj")):
                full = f"{p}self_attn.{name}"
                bias = take_bias(full + ".bias", self.arch.attention_bias)
                layer.qkv_proj.load_part(part, take(full + ".weight"), bias, full + ".weight")
            layer.o_proj.load(take(p + "self_attn.o_proj.weight"), name=p + "self_attn.o_proj.weight")
            _copy(
                layer.post_attention_layernorm.weight,
                take(p + "post_attention_layernorm.weight"),
                p + "post_attention_layernorm.weight",
            )
            for part, name in enumerate(("gate_proj", "up_proj")):
                full = f"{p}mlp.{name}.weight"
                layer.gate_up_proj.load_part(part, take(full), name=full)
            layer.down_proj.load(take(p + "mlp.down_proj.weight"), name=p + "mlp.down_proj.weight")
        _copy(self.norm.weight, take("model.norm.weight"), "model.norm.weight")
        if self.arch.tie_word_embeddings:
            # Some checkpoints store the tied head anyway; it must equal the embedding.
            remaining.pop("lm_head.weight", None)
        else:
            _copy(self.lm_head_weight, take("lm_head.weight"), "lm_head.weight")
        # Rotary inverse frequencies are recomputed from rope_theta, not loaded.
        unexpected = sorted(n for n in remaining if not n.endswith("rotary_emb.inv_freq"))
        if unexpected:
            raise ValueError(f"unexpected tensor {unexpected[0]!r} ({len(unexpected)} unexpected in all)")


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(src.shape) != tuple(dst.shape):
        raise ValueError(f"{name}: expected shape {tuple(dst.shape)}, got {tuple(src.shape)}")
    dst.copy_(src)
