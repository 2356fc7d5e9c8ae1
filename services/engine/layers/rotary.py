"""Llama rotary position embedding with Hugging Face's ``rotate_half`` convention.

The cos/sin tables are precomputed for every position up to ``max_len``; a step looks its
positions up once (``lookup``) and every layer reuses the result.
"""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        max_len: int,
        theta: float,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary head_dim must be even, got {head_dim}")
        inv_freq = 1.0 / (
            theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim)
        )
        t = torch.arange(max_len, dtype=torch.float32, device=device)
        freqs = torch.outer(t, inv_freq)  # (max_len, head_dim/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (max_len, head_dim)
        self.max_len = max_len
        self.register_buffer("cos_cache", emb.cos().to(dtype), persistent=False)
        self.register_buffer("sin_cache", emb.sin().to(dtype), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for ``positions`` (T,), shaped (T, 1, head_dim) to broadcast over heads."""
        return self.cos_cache[positions].unsqueeze(1), self.sin_cache[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (T, heads, head_dim) by the looked-up angles."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # rotate_half
    return x * cos + rotated * sin
