"""The embedding rows an allocator's blocks index: one (num_blocks * block_size, hidden)
tensor, plus each allocation's aux true length (what the transfer's reply
carries beside the rows)."""

from __future__ import annotations

import torch

from services.engine.multimodal.blocks import BlockAllocation


class EmbeddingBuffers:
    def __init__(self, num_blocks: int, block_size: int, hidden: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        self.block_size = block_size
        self.rows = torch.zeros(num_blocks * block_size, hidden, dtype=dtype, device=device)
        self._aux: dict[int, int] = {}  # start_block -> true length of the whole image

    def chunk_info(self, allocation: BlockAllocation, offset_tokens: int, max_tokens: int) -> tuple[int, int]:
        """(offset_bytes, size_bytes) in ``rows`` of up to ``max_tokens`` rows of ``allocation``
        starting at its row ``offset_tokens`` (what a zero-copy transport would send)."""
        n = max(0, min(max_tokens, allocation.num_tokens - offset_tokens))
        row_bytes = self.rows.shape[1] * self.rows.element_size()
        return (allocation.start_block * self.block_size + offset_tokens) * row_bytes, n * row_bytes

    def write(self, allocation: BlockAllocation, embeds: torch.Tensor, true_length: int) -> None:
        """Put ``embeds`` (n, hidden), n <= allocation.num_tokens, at the allocation's start."""
        if embeds.shape[0] > allocation.num_tokens:
            raise ValueError(f"{embeds.shape[0]} rows do not fit an allocation of {allocation.num_tokens}")
        start = allocation.start_block * self.block_size
        self.rows[start : start + embeds.shape[0]] = embeds
        self._aux[allocation.start_block] = true_length

    def read(self, allocation: BlockAllocation, n: int, offset: int = 0) -> tuple[torch.Tensor, int]:
        """(rows offset..offset+n of the allocation (a copy), the aux true length)."""
        if offset + n > allocation.num_tokens:
            raise ValueError(f"rows {offset}..{offset + n} are outside an allocation of {allocation.num_tokens}")
        start = allocation.start_block * self.block_size + offset
        return self.rows[start : start + n].clone(), self._aux.get(allocation.start_block, 0)

    def release(self, allocation: BlockAllocation) -> None:
        self._aux.pop(allocation.start_block, None)
