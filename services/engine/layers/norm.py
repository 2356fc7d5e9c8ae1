"""RMSNorm (torch's fused kernel; float32 statistics) with an optional residual add."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        eps: float,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.eps = eps
        self.normalized_shape = (hidden_size,)
        self.weight = nn.Parameter(
            torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False
        )

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(norm(x + residual), x + residual)``; the sum is the next residual stream."""
        if residual is not None:
            x = x + residual  # (T, H)
        # NOTE: equals HF's LlamaRMSNorm exactly in float32; in bf16 it differs only in
        # where the final product is rounded.
        return F.rms_norm(x, self.normalized_shape, self.weight, self.eps), x
