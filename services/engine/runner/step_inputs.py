"""Turns a ScheduledBatch into the tensors of one forward step (built once per step).

Flat token order: the prefill chunks (sequences with more than one new token) in batch
order, then one token per decode sequence in batch order, which is what
``AttentionMetadata`` expects.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from services.engine.batch import ScheduledBatch, ScheduledSeq
from services.engine.layers.attention import AttentionMetadata, build_attention_metadata


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # (N,) int64: flat row of each sampled sequence's last token
    sample_index: list[int]  # batch index of each sampled sequence, in sample_rows order
    sample_seqs: list[ScheduledSeq]
    has_futures: bool = False  # input_ids hold placeholders (< 0) for the runner to resolve
    mm_rows: torch.Tensor | None = None  # (M,) int64: flat rows whose embedding is an image's
    mm_embeds: torch.Tensor | None = None  # (M, H): the image embeddings for those rows
    # (batch index, flat row of its first token) of each sequence with prompt_targets
    prompt_rows: list[tuple[int, int]] = field(default_factory=list)


def validate_batch(batch: ScheduledBatch, block_size: int, num_blocks: int, max_model_len: int) -> None:
    """Raise ValueError naming the sequence whose work does not fit the cache or the model."""
    for s in batch.seqs:
        if not s.token_ids:
            raise ValueError(f"sequence {s.request_id!r}: no tokens scheduled")
        if s.start_pos < 0:
            raise ValueError(f"sequence {s.request_id!r}: negative start_pos {s.start_pos}")
        end = s.end_pos
        if end > max_model_len:
            raise ValueError(f"sequence {s.request_id!r}: end position {end} exceeds max_model_len {max_model_len}")
        used = (end + block_size - 1) // block_size
        if len(s.block_ids) < used:
            raise ValueError(
                f"sequence {s.request_id!r}: {len(s.block_ids)} blocks cannot hold {end} tokens"
                f" (block_size {block_size})"
            )
        table = s.block_ids[:used]
        if min(table) < 0 or max(table) >= num_blocks:
            raise ValueError(f"sequence {s.request_id!r}: block id out of range [0, {num_blocks})")


def build_step_inputs(
    batch: ScheduledBatch, block_size: int, device: torch.device, dtype: torch.dtype, per_token: bool = False
) -> StepInputs:
    prefill_idx = [i for i, s in enumerate(batch.seqs) if len(s.token_ids) > 1]
    decode_idx = [i for i, s in enumerate(batch.seqs) if len(s.token_ids) == 1]
    ids: list[int] = []
    positions: list[int] = []
    last_row: dict[int, int] = {}
    for i in prefill_idx:
        s = batch.seqs[i]
        ids.extend(s.token_ids)
        positions.extend(range(s.start_pos, s.end_pos))
        last_row[i] = len(ids) - 1
    for i in decode_idx:
        s = batch.seqs[i]
        ids.append(s.token_ids[0])
        positions.append(s.start_pos)
        last_row[i] = len(ids) - 1
    meta = build_attention_metadata(
        [(batch.seqs[i].start_pos, batch.seqs[i].block_ids, len(batch.seqs[i].token_ids)) for i in prefill_idx],
        [(batch.seqs[i].start_pos, batch.seqs[i].block_ids) for i in decode_idx],
        block_size,
        device,
        dtype,
        per_token,
    )
    sample_index = [i for i, s in enumerate(batch.seqs) if s.sample]
    mm_rows, mm_embeds = _image_rows(batch, last_row, device, dtype)
    return StepInputs(
        input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        meta=meta,
        sample_rows=torch.tensor([last_row[i] for i in sample_index], dtype=torch.int64, device=device),
        sample_index=sample_index,
        sample_seqs=[batch.seqs[i] for i in sample_index],
        has_futures=bool(ids) and min(ids) < 0,
        mm_rows=mm_rows,
        mm_embeds=mm_embeds,
        prompt_rows=[(i, last_row[i] - len(s.token_ids) + 1)
                     for i, s in enumerate(batch.seqs) if s.prompt_targets],
    )


def _image_rows(
    batch: ScheduledBatch, last_row: dict[int, int], device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The flat rows this step computes that are image placeholders, and their embeddings
    (a chunk may hold any part of an image: only the overlap is taken)."""
    rows: list[torch.Tensor] = []
    parts: list[torch.Tensor] = []
    for i, s in enumerate(batch.seqs):
        if not s.images:
            continue
        first_row = last_row[i] - len(s.token_ids) + 1
        for span in s.images:
            lo, hi = max(span.offset, s.start_pos), min(span.end, s.end_pos)
            if lo >= hi:
                continue
            if span.embeds is None:
                raise ValueError(f"sequence {s.request_id!r}: image at {span.offset} has no embeddings")
            row0 = first_row + lo - s.start_pos
            rows.append(torch.arange(row0, row0 + hi - lo, dtype=torch.int64))
            parts.append(span.embeds[lo - span.offset : hi - span.offset])
    if not rows:
        return None, None
    return torch.cat(rows).to(device), torch.cat([p.to(device, dtype) for p in parts])
