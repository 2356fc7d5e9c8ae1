"""A decode-only step's decoder stack in one call of decode.cpp's ``decode_forward``; also a
step whose prefill is small beside its decodes, and in ``engine.deterministic`` mode every
step, each new token its own row (the runner builds those rows: ``TokenRows``).

Where the model runs on our int4 CPU kernels (every decoder linear an Int4Matmul on the
kernel, bfloat16, no tensor parallelism), a step whose rows are all single decode tokens
(no image rows) skips the eager per-layer forward: about 2,500 small torch ops a step,
which at one sequence cost more than the weights' bytes. It beats the eager forward's
dense bfloat16 GEMMs at 32 and 64 sequences too (docs/benchmarks.md, "Engine").
The numbers differ from the eager bfloat16 forward only in rounding: the residual stream
stays float32 and each matmul's output is not rounded to bfloat16 (on the int8 paths the
matmuls' inputs are rounded to int8 per 32-group, as the eager forward's are there too).

Small mixed steps: the eager forward's fixed cost (~50 ms with one thread on SmolLM2) is
more than the kernel's per-row cost for a few dozen prefill tokens, so under an ITL
target, whose steps carry small chunks beside the streams, the runner sends a step with
up to ``ONE_CALL_PREFILL_TOKENS`` prefill tokens here (docs/benchmarks.md "The prefill
budget under an ITL target").

Deterministic mode: the kernel computes each row alone in a fixed order (the matmuls'
rows do not mix, attention reads the row's context from the cache key by key), and a
prefill chunk's tokens are rows like any decode token (each one's K/V is in the cache
before any row of the layer attends). So a token's K/V and logits are the same bits
whatever else shares the step, however its prompt was chunked, and whether its prefix
came from the cache.
"""

from __future__ import annotations

import torch

from services.engine.layers.attention import AttentionMetadata
from services.engine.quant.linear import Int4Matmul, QuantizedLinear

_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # decode_forward's order
# A step with at most this many prefill tokens runs here, each token a row. Measured with
# one thread (AMD EPYC, avx512_bf16; 8 decodes at 256 context): 16 tokens 56 vs 86 ms
# eager, 32: 82 vs 98, 64: 135 vs 135, 128: 251 vs 216.
ONE_CALL_PREFILL_TOKENS = 32
# Kernel sets on which a prefill of any size runs here too under engine.cpu_prefill: auto.
# Measured on an AVX2-only AMD EPYC (2 threads, one engine alternating the two paths): the
# rows path 2.3x the eager forward's tok/s at 64 tokens, 1.5x at 256, 1.15x at 850, 1.06x
# at 2,048 (docs/benchmarks.md). The other sets keep the eager forward until measured:
# on avx512_bf16 it was faster from 128 tokens, on avx512_vnni rows prefilled at 0.59x
# (both 2026-11-26, before the rows' attention shared keys), NEON is unmeasured.
ROWS_PREFILL_SETS = frozenset({"avx2"})


def _kernel_matmul(linear: torch.nn.Module) -> Int4Matmul | None:
    if isinstance(linear, QuantizedLinear) and isinstance(linear.matmul, Int4Matmul) and linear.matmul.kernels:
        return linear.matmul
    return None


class CpuDecode:
    """The weights of every layer in ``decode_forward``'s order, gathered once at load."""

    def __init__(self, model: torch.nn.Module, block_size: int) -> None:
        arch = model.arch
        first = _kernel_matmul(model.layers[0].qkv_proj)
        assert first is not None and first.kernels is not None  # supports() checked
        self._decode_forward = getattr(torch.ops, first.kernels.namespace).decode_forward
        self.dims = [arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim,
                     arch.intermediate_size, arch.num_layers, block_size]
        self.eps = float(model.norm.eps)
        self.embed = model.embed_tokens.weight
        self.final_norm = model.norm.weight
        # float32 copies of the model's (bfloat16) tables: the same angles, no per-step cast
        self.cos = model.rotary.cos_cache.float().contiguous()
        self.sin = model.rotary.sin_cache.float().contiguous()
        self.weights: list[torch.Tensor] = []
        empty = torch.empty(0)
        for layer in model.layers:
            qkv, o, gu, down = (_kernel_matmul(getattr(layer, a)) for a in _LINEARS)
            assert qkv and o and gu and down
            bias = layer.qkv_proj.bias
            self.weights += [layer.input_layernorm.weight, qkv.codes, qkv.scale_min,
                             empty if bias is None else bias.float().contiguous(),
                             o.codes, o.scale_min, layer.post_attention_layernorm.weight,
                             gu.codes, gu.scale_min, down.codes, down.scale_min]

    @staticmethod
    def supports(model: torch.nn.Module) -> bool:
        """Whether every layer runs on the kernels (and nothing decode.cpp lacks is on). The
        runner asks only without tensor parallelism: the one call has no all-reduce."""
        if model.embed_tokens.weight.dtype != torch.bfloat16 or model.arch.head_dim % 16:
            return False
        for layer in model.layers:
            if any(_kernel_matmul(getattr(layer, a)) is None for a in _LINEARS):
                return False
            if layer.o_proj.bias is not None or layer.gate_up_proj.bias is not None or layer.down_proj.bias is not None:
                return False
        return True

    def takes(self, meta: AttentionMetadata, mm_rows: torch.Tensor | None) -> bool:
        if mm_rows is not None:
            return False
        if meta.token_rows is not None:  # the runner built one row per token for this call
            return True
        # NOTE: CUDA graphs' padded metadata has no ctx_len (and never reaches a CPU model).
        return meta.num_prefill_tokens == 0 and meta.decode is not None and meta.decode.ctx_len is not None

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 kv_layers: list[torch.Tensor]) -> torch.Tensor:
        rows = meta.token_rows if meta.token_rows is not None else meta.decode
        assert rows is not None and rows.ctx_len is not None  # takes() checked
        return self._decode_forward(
            input_ids, positions, meta.slot_mapping, rows.block_table, rows.ctx_len, self.embed, kv_layers,
            self.weights, self.cos, self.sin, self.final_norm, self.dims, self.eps)
