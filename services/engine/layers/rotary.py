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
        sin = emb.sin()
        # rotate_half(x) * sin == swap_halves(x) * [-sin_1, sin_2]: fold the sign in once.
        signed_sin = torch.cat((-sin[:, : head_dim // 2], sin[:, head_dim // 2 :]), dim=-1)
        self.register_buffer("cos_cache", emb.cos().to(dtype), persistent=False)
        self.register_buffer("sin_cache", signed_sin.to(dtype), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin for ``positions`` (T,), shaped (T, 1, head_dim)."""
        return self.cos_cache[positions].unsqueeze(1), self.sin_cache[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (T, heads, head_dim) by angles from ``RotaryEmbedding.lookup``.

    Equals HF's ``x * cos + rotate_half(x) * sin``.
    """
    t, h, d = x.shape
    swapped = x.view(t, h, 2, d // 2).flip(2).view(t, h, d)  # [x2, x1]
    return torch.addcmul(x * cos, swapped, signed_sin)
