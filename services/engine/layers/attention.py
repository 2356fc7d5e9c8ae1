"""Paged attention over the block-table KV cache.

Per layer the cache is ``(2, num_blocks, block_size, kv_heads, head_dim)`` (K, V); a token at position ``p`` of a sequence lives at slot
``block_ids[p // block_size] * block_size + p % block_size``. A step first writes the new
tokens' K/V at their slots, then every new token attends over its sequence's context
``[0, its position]`` read back through the block table.

The flat token order of a step is: all prefill-chunk tokens (chunk by chunk), then one token
per decode sequence. Prefill chunks are few and loop in Python; decode sequences are
attended in one padded, masked SDPA call. Everything that does not depend on the layer
lives in ``AttentionMetadata``, built once per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillChunk:
    """A sequence with several new tokens: flat token rows ``[start, end)``.

    ``ctx_blocks`` (nb,) are the blocks holding the context ``[0, ctx_len)`` and ``mask``
    (n, ctx_len) is the additive causal mask over it; both are None when the chunk starts at
    position 0, in which case attention runs on the fresh K/V with ``is_causal``.
    """

    start: int
    end: int
    ctx_len: int = 0
    ctx_blocks: torch.Tensor | None = None
    mask: torch.Tensor | None = None


@dataclass(slots=True)
class DecodeGroup:
    """Sequences with exactly one new token, attended together.

    ``block_table`` (D, nb_max) is each sequence's block table padded with block 0;
    ``mask`` (D, 1, 1, nb_max * block_size) is 0 on each sequence's real context, -inf after.
    ``ctx_len`` is what the CPU decode kernel reads instead of the mask.
    Gathering whole blocks (not single slots) keeps the per-layer copy a few large memcpys.
    """

    block_table: torch.Tensor
    mask: torch.Tensor
    ctx_len: torch.Tensor | None = None  # (D,) int64: context length with the new token


@dataclass(slots=True)
class TokenRows:
    """Every new token as its own row, as the CPU step kernel attends them in
    ``engine.deterministic`` mode: its sequence's block table (T, nb_max), padded with
    block 0, and its context length with itself (T,)."""

    block_table: torch.Tensor
    ctx_len: torch.Tensor


@dataclass(slots=True)
class AttentionMetadata:
    """What attention needs for one step, shared by every layer."""

    slot_mapping: torch.Tensor  # (T,) int64: cache slot of each new token
    num_prefill_tokens: int  # rows [0, P) are prefill chunks, [P, T) decode tokens
    prefills: list[PrefillChunk] = field(default_factory=list)
    decode: DecodeGroup | None = None
    token_rows: TokenRows | None = None  # built only when asked (per_token)


def build_attention_metadata(
    prefills: list[tuple[int, list[int], int]],
    decodes: list[tuple[int, list[int]]],
    block_size: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    per_token: bool = False,
) -> AttentionMetadata:
    """Build the metadata for one step; masks are additive (0 / -inf) in ``dtype``.

    ``prefills``: ``(start_pos, block_ids, num_new_tokens)`` per chunk, in flat order;
    ``decodes``: ``(position, block_ids)`` per single-token sequence, after the prefills.
    ``per_token``: each token's own row (``TokenRows``) instead of the chunks' masks and
    the decode group's table, which the one-call kernel of ``engine.deterministic`` never
    reads (the chunks keep their rows and lengths).
    """
    slots: list[int] = []
    chunks: list[PrefillChunk] = []
    row = 0
    for start_pos, block_ids, n in prefills:
        end_pos = start_pos + n
        slots.extend(block_ids[p // block_size] * block_size + p % block_size for p in range(start_pos, end_pos))
        chunk = PrefillChunk(start=row, end=row + n, ctx_len=end_pos)
        if start_pos > 0 and not per_token:
            used = (end_pos + block_size - 1) // block_size
            chunk.ctx_blocks = torch.tensor(block_ids[:used], dtype=torch.int64, device=device)
            q_pos = torch.arange(start_pos, end_pos, device=device)
            chunk.mask = _additive(torch.arange(end_pos, device=device)[None, :] <= q_pos[:, None], dtype)  # (n, L)
        chunks.append(chunk)
        row += n
    decode = None
    if decodes:
        slots.extend(bt[p // block_size] * block_size + p % block_size for p, bt in decodes)
    if decodes and not per_token:
        max_blocks = max(p // block_size for p, _ in decodes) + 1
        # NOTE: only the blocks a sequence uses are read; ids past them are not validated.
        rows = [bt[: p // block_size + 1] for p, bt in decodes]
        table = torch.tensor(
            [r + [0] * (max_blocks - len(r)) for r in rows],
            dtype=torch.int64,
            device=device,
        )  # (D, nb_max)
        ctx_len = torch.tensor([p + 1 for p, _ in decodes], dtype=torch.int64, device=device)
        pos = torch.arange(max_blocks * block_size, device=device)
        mask = pos[None, :] < ctx_len[:, None]  # (D, L_pad)
        decode = DecodeGroup(block_table=table, mask=_additive(mask, dtype)[:, None, None, :], ctx_len=ctx_len)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        num_prefill_tokens=row,
        prefills=chunks,
        decode=decode,
        token_rows=_token_rows(prefills, decodes, block_size, device) if per_token else None,
    )


def _token_rows(prefills: list[tuple[int, list[int], int]], decodes: list[tuple[int, list[int]]],
                block_size: int, device: torch.device) -> TokenRows:
    seqs = [*prefills, *((p, ids, 1) for p, ids in decodes)]
    width = max((start + n - 1) // block_size + 1 for start, _, n in seqs)
    tables: list[list[int]] = []
    ctx: list[int] = []
    for start, ids, n in seqs:
        table = ids[:width] + [0] * (width - min(len(ids), width))
        tables.extend([table] * n)
        ctx.extend(range(start + 1, start + n + 1))
    return TokenRows(torch.tensor(tables, dtype=torch.int64, device=device),
                     torch.tensor(ctx, dtype=torch.int64, device=device))


def _additive(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # NOTE: SDPA turns a bool mask into an additive one on every call; doing it here once
    # per step saves that per layer.
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(~keep, float("-inf"))


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """The step's new K/V (T, Hkv, hd) into one layer's cache at their slots (T,)."""
    kv_cache[0].view(-1, k.shape[1], k.shape[2]).index_copy_(0, slot_mapping, k)
    kv_cache[1].view(-1, v.shape[1], v.shape[2]).index_copy_(0, slot_mapping, v)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """Write the new K/V into the cache, then attend.

    q (T, Hq, hd); k, v (T, Hkv, hd); kv_cache (2, num_blocks, block_size, Hkv, hd): one
    layer's K and V. Returns (T, Hq, hd).
    """
    num_heads, num_kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
    write_kv(k, v, kv_cache, meta.slot_mapping)
    if meta.decode is None and len(meta.prefills) == 1:
        return _prefill(q, k, v, kv_cache, meta.prefills[0])
    out = torch.empty_like(q)
    for chunk in meta.prefills:
        out[chunk.start : chunk.end] = _prefill(q, k, v, kv_cache, chunk)
    if meta.decode is not None:
        p = meta.num_prefill_tokens
        d = meta.decode
        n, nb = d.block_table.shape
        group = num_heads // num_kv_heads
        blocks = d.block_table.view(-1)
        qd = q[p:].view(n, num_kv_heads, group, head_dim)  # (D, Hkv, G, hd): GQA without expand
        kvd = kv_cache.index_select(1, blocks).view(2, n, -1, num_kv_heads, head_dim)  # (2, D, L, Hkv, hd)
        kd, vd = kvd[0].transpose(1, 2), kvd[1].transpose(1, 2)  # (D, Hkv, L, hd) each
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=d.mask)  # (D, Hkv, G, hd)
        out[p:] = od.reshape(n, num_heads, head_dim)
    return out


def _prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    chunk: PrefillChunk,
) -> torch.Tensor:
    n = chunk.end - chunk.start
    num_heads, num_kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
    group = num_heads // num_kv_heads
    # GQA as a (kv_head, group) batch with K/V expanded by stride 0: no copy, and unlike
    # enable_gqa=True it keeps SDPA on the fused CPU kernel instead of the math fallback.
    qc = q[chunk.start : chunk.end].view(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # (Hkv, G, n, hd)
    if chunk.ctx_blocks is None:
        kc = k[chunk.start : chunk.end]  # (n, Hkv, hd)
        vc = v[chunk.start : chunk.end]
    else:
        kvc = kv_cache.index_select(1, chunk.ctx_blocks).view(2, -1, num_kv_heads, head_dim)
        kc, vc = kvc[0, : chunk.ctx_len], kvc[1, : chunk.ctx_len]  # (L, Hkv, hd) each
    length = kc.shape[0]
    kc = kc.permute(1, 0, 2).unsqueeze(1).expand(num_kv_heads, group, length, head_dim)  # (Hkv, G, L, hd)
    vc = vc.permute(1, 0, 2).unsqueeze(1).expand(num_kv_heads, group, length, head_dim)
    if chunk.mask is None:
        o = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True)  # (Hkv, G, n, hd)
    else:
        o = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=chunk.mask)
    return o.permute(2, 0, 1, 3).reshape(n, num_heads, head_dim)  # (n, Hq, hd)
