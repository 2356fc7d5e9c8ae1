"""An int8 weight, symmetric per output channel: ``W[n] ~= q[n] * scale[n]``."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Int8Rows:
    """``q`` int8 (out, in), ``scale`` float32 (out,)."""

    q: torch.Tensor
    scale: torch.Tensor

    @classmethod
    def from_float(cls, w: torch.Tensor) -> Int8Rows:
        w = w.float()
        scale = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)  # (N,)
        q = (w / scale.unsqueeze(1)).round().clamp(-127, 127).to(torch.int8)
        return cls(q, scale)

    @property
    def in_features(self) -> int:
        return self.q.shape[1]

    group_size = 1  # any column range is whole: the scales span the row

    def rows(self, start: int, stop: int) -> Int8Rows:
        return Int8Rows(self.q[start:stop], self.scale[start:stop])

    def cols(self, start: int, stop: int) -> Int8Rows:
        """Input columns ``start:stop``, with the whole row's scales: the partial products
        of every column range sum to the whole row's."""
        return Int8Rows(self.q[:, start:stop].contiguous(), self.scale)


def cat_rows(parts: list[Int8Rows]) -> Int8Rows:
    return Int8Rows(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]))
