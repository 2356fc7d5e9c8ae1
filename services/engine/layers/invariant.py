"""Batch-invariant CUDA kernels (Triton) for ``engine.deterministic`` on a GPU.

cuBLAS, torch's reductions and SDPA pick their tiling, split-K and reduction tree from the
whole call's shape, so a row's bits depend on how many rows share its step and how its
prompt was chunked. These kernels fix every choice that decides a row's arithmetic at
compile time, independent of the row count:

- ``linear``: one tile size, no split-K; an output element is its row's dot product over
  K in ``BLOCK_K`` steps, whatever the other rows hold or how many there are.
- ``rms_norm``: one program per row, the whole row in one block.
- ``token_attention``: programs per (token row, query head, split of 256 keys) that read
  the row's own context from the paged cache, 64 keys at a time, with an online softmax,
  and a second kernel merging a row's splits in order. Where the splits fall depends on
  the position alone, so a token's output depends on its context length and the cached
  K/V alone: the same whether its prompt came in one chunk, in many, or from the prefix
  cache.

Elementwise work (rotary, SiLU, residual adds, embeddings) is invariant as torch does it.
``make_batch_invariant`` swaps these into a loaded ``LlamaModel``; the runner builds the
per-token metadata (``TokenRows``) every step. Triton is imported here only, so CPU-only
installs never need it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl
from torch import nn

from services.engine.layers.attention import AttentionMetadata, TokenRows, write_kv

# NOTE: tile sizes are part of the numbers: changing one changes every row's bits (not their
# invariance). 64x64x64 keeps a decode step's few rows cheap and fills the chip at prefill.
_BLOCK_M, _BLOCK_N, _BLOCK_K = 64, 64, 64
_ATTN_BLOCK = 64
_ATTN_SPLIT = 256  # keys per attention program; a multiple of _ATTN_BLOCK


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(a_ptr, w_ptr, c_ptr, M, N, K, stride_am, stride_wn, stride_cm,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = tl.load(a_ptr + rm[:, None] * stride_am + kk[None, :],
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        w = tl.load(w_ptr + rn[:, None] * stride_wn + kk[None, :],
                    mask=(rn[:, None] < N) & (kk[None, :] < K), other=0.0)
        if IEEE:
            acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(w), acc)
    tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)``, x (..., K), weight (N, K): each row's result is the same
    bits at any row count."""
    shape = x.shape
    a = x.reshape(-1, shape[-1])
    if a.stride(-1) != 1:
        a = a.contiguous()
    m, k = a.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        grid = (triton.cdiv(m, _BLOCK_M), triton.cdiv(n, _BLOCK_N))
        _linear_kernel[grid](a, weight, out, m, n, k, a.stride(0), weight.stride(0), out.stride(0),
                             BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K,
                             IEEE=x.dtype == torch.float32)
    if bias is not None:
        out += bias
    return out.view(*shape[:-1], n)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, H, stride_x, stride_y, eps,
                     BLOCK_H: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    keep = cols < H
    x = tl.load(x_ptr + row * stride_x + cols, mask=keep, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
    w = tl.load(w_ptr + cols, mask=keep, other=0.0).to(tl.float32)
    # rounded to the input dtype before the weight, as Hugging Face's LlamaRMSNorm does
    y = (x * rstd).to(y_ptr.dtype.element_ty).to(tl.float32) * w
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=keep)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x (T, H), one program per row."""
    t, h = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty_like(x)
    if t:
        _rms_norm_kernel[(t,)](x, weight, y, h, x.stride(0), y.stride(0), eps,
                               BLOCK_H=triton.next_power_of_2(h))
    return y


@triton.jit(do_not_specialize=["max_splits"])
def _token_attention_split_kernel(q_ptr, k_ptr, v_ptr, part_ptr, table_ptr, ctx_ptr,
                                  stride_qt, stride_qh, stride_tt, stride_slot, stride_kvh, scale, max_splits,
                                  NUM_HEADS: tl.constexpr,
                                  GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                                  HD_PAD: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr):
    """One (token row, head, split): keys [split * SPLIT, +SPLIT) of the row's context.
    Writes (max, sum, acc[HD_PAD]) of the split's online softmax to ``part``."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    ctx = tl.load(ctx_ptr + t)
    lo = sp * SPLIT
    if lo < ctx:
        hi = tl.minimum(lo + SPLIT, ctx)
        kvh = h // GROUP
        d = tl.arange(0, HD_PAD)
        dmask = d < HEAD_DIM
        q = tl.load(q_ptr + t * stride_qt + h * stride_qh + d, mask=dmask, other=0.0).to(tl.float32)
        offs = tl.arange(0, BLOCK_N)
        m = tl.full((), float("-inf"), tl.float32)
        denom = tl.zeros((), tl.float32)
        acc = tl.zeros((HD_PAD,), tl.float32)
        for start in range(lo, hi, BLOCK_N):
            pos = start + offs
            valid = pos < hi
            blk = tl.load(table_ptr + t * stride_tt + pos // BLOCK_SIZE, mask=valid, other=0)
            slot = blk * BLOCK_SIZE + pos % BLOCK_SIZE
            kv_off = slot[:, None] * stride_slot + kvh * stride_kvh + d[None, :]
            kv_mask = valid[:, None] & dmask[None, :]
            k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
            s = tl.sum(k * q[None, :], axis=1) * scale
            s = tl.where(valid, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=0))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new)
            v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
            denom = denom * alpha + tl.sum(p, axis=0)
            acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
            m = m_new
        base = part_ptr + ((t * NUM_HEADS + h) * max_splits + sp) * (HD_PAD + 2)
        tl.store(base, m)
        tl.store(base + 1, denom)
        tl.store(base + 2 + d, acc)


@triton.jit(do_not_specialize=["max_splits"])
def _token_attention_combine_kernel(part_ptr, o_ptr, ctx_ptr, stride_ot, stride_oh, max_splits,
                                    NUM_HEADS: tl.constexpr,
                                    HEAD_DIM: tl.constexpr, HD_PAD: tl.constexpr, SPLIT: tl.constexpr):
    """One (token row, head): its splits merged in order 0, 1, ... (a row's split count
    is its context length's alone)."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    ctx = tl.load(ctx_ptr + t)
    d = tl.arange(0, HD_PAD)
    row = part_ptr + (t * NUM_HEADS + h) * max_splits * (HD_PAD + 2)
    m = tl.load(row)
    denom = tl.load(row + 1)
    acc = tl.load(row + 2 + d)
    for sp in range(1, tl.cdiv(ctx, SPLIT)):
        base = row + sp * (HD_PAD + 2)
        m_s = tl.load(base)
        m_new = tl.maximum(m, m_s)
        a, b = tl.exp(m - m_new), tl.exp(m_s - m_new)
        denom = denom * a + tl.load(base + 1) * b
        acc = acc * a + tl.load(base + 2 + d) * b
        m = m_new
    out = acc / denom
    tl.store(o_ptr + t * stride_ot + h * stride_oh + d, out.to(o_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def token_attention(q: torch.Tensor, kv_cache: torch.Tensor, rows: TokenRows) -> torch.Tensor:
    """q (T, Hq, hd) over each row's context ``[0, ctx_len)`` in one layer's cache
    (2, blocks, block_size, Hkv, hd), read through the row's block table. Returns (T, Hq, hd).

    The context is cut into splits of ``_ATTN_SPLIT`` keys from position 0, each its own
    program (a long context still fills the GPU at one row), merged in order by a second
    kernel: where the splits fall depends on the position alone, so the bits do too."""
    t, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    out = torch.empty(t, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if t == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    table = rows.block_table
    # the table's width bounds every row's context: no device read to size the grid
    max_splits = triton.cdiv(table.shape[1] * block_size, _ATTN_SPLIT)
    hd_pad = triton.next_power_of_2(head_dim)
    part = torch.empty(t, num_heads, max_splits, hd_pad + 2, dtype=torch.float32, device=q.device)
    _token_attention_split_kernel[(t, num_heads, max_splits)](
        q, k_cache, v_cache, part, table, rows.ctx_len,
        q.stride(0), q.stride(1), table.stride(0), k_cache.stride(1), k_cache.stride(2), head_dim ** -0.5,
        max_splits, NUM_HEADS=num_heads, GROUP=num_heads // num_kv_heads, BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim, HD_PAD=hd_pad, BLOCK_N=_ATTN_BLOCK, SPLIT=_ATTN_SPLIT)
    _token_attention_combine_kernel[(t, num_heads)](
        part, out, rows.ctx_len, out.stride(0), out.stride(1), max_splits,
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, HD_PAD=hd_pad, SPLIT=_ATTN_SPLIT)
    return out


def invariant_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                        meta: AttentionMetadata) -> torch.Tensor:
    """``paged_attention``'s contract on per-token metadata: write the new K/V, then attend."""
    if meta.token_rows is None:
        raise ValueError("batch-invariant attention needs per-token metadata (TokenRows)")
    write_kv(k, v, kv_cache, meta.slot_mapping)
    return token_attention(q, kv_cache, meta.token_rows)


class InvariantLinear(nn.Module):
    """A dense linear on ``linear``, over a replaced layer's weight and bias; ``split``: its
    ``split_output`` (fused q/k/v and gate/up)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 split: Callable[[torch.Tensor], list[torch.Tensor]] | None = None) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias
        self._split = split

    def split_output(self, y: torch.Tensor) -> list[torch.Tensor]:
        assert self._split is not None
        return self._split(y)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class InvariantRMSNorm(nn.Module):
    """``RMSNorm``'s contract (norm of x + residual, and the sum) on ``rms_norm``."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual
        return rms_norm(x, self.weight, self.eps), x


def make_batch_invariant(model: nn.Module) -> None:
    """Swap a loaded dense ``LlamaModel``'s linears, norms, attention and LM head for the
    kernels above. Raises ValueError for a model whose linears are not dense tensors."""
    if model.lm_head is not None:
        raise ValueError("batch-invariant kernels need a dense LM head")
    for layer in model.layers:
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            dense = getattr(layer, name)
            if not isinstance(getattr(dense, "weight", None), torch.Tensor):
                raise ValueError(f"batch-invariant kernels need dense weights, not {type(dense).__name__}")
            setattr(layer, name, InvariantLinear(dense.weight, dense.bias, getattr(dense, "split_output", None)))
        layer.input_layernorm = InvariantRMSNorm(layer.input_layernorm)
        layer.post_attention_layernorm = InvariantRMSNorm(layer.post_attention_layernorm)
        layer.attend = invariant_attention
    model.norm = InvariantRMSNorm(model.norm)
    model.lm_head = InvariantLinear(model.lm_head_weight)
