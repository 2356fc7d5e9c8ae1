"""Token sampling for a batch: greedy, temperature, top-k, top-p and per-request seeds.

Sampling uses the exponential-race trick: ``argmax(probs / E)`` with ``E ~ Exp(1)`` i.i.d.
per vocabulary entry draws from ``probs``. Drawing the noise, not the token, from a
generator makes a seeded request reproducible: the noise of a seeded row comes from its
own generator seeded from ``(seed, num_generated)``, so the same request gives the same
tokens whatever else shares the batch and wherever its row is. Unseeded rows share one
engine generator.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.engine.batch import ScheduledSeq

_MASK64 = (1 << 64) - 1


def _mix_seed(seed: int, step: int) -> int:
    """A 63-bit generator seed from (request seed, step) — splitmix64 finaliser."""
    z = (seed * 0x9E3779B97F4A7C15 + step + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


class Sampler:
    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)

    def sample(self, logits: torch.Tensor, seqs: Sequence[ScheduledSeq]) -> list[int]:
        """logits (B, V), one row per seq in ``seqs`` -> one token id per row."""
        if logits.shape[0] != len(seqs):
            raise ValueError(f"logits has {logits.shape[0]} rows for {len(seqs)} sequences")
        params = [s.sampling for s in seqs]
        greedy_rows = [p.greedy for p in params]
        if all(greedy_rows):
            return logits.argmax(dim=-1).tolist()
        dev = logits.device
        logits = logits.float()
        # Greedy rows go through the same math with temperature 1, then get the argmax.
        temps = torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy_rows, strict=True)], device=dev)
        scaled = logits / temps[:, None]  # (B, V)
        if any(p.top_k > 1 or p.top_p < 1.0 for p in params):
            scaled = self._top_k_top_p(scaled, params)
        probs = torch.softmax(scaled, dim=-1)  # (B, V)
        noise = self._exponential_noise(seqs, probs.shape, dev)
        sampled = (probs / noise).argmax(dim=-1)  # (B,)
        if any(greedy_rows):
            greedy = torch.tensor(greedy_rows, device=dev)
            sampled = torch.where(greedy, logits.argmax(dim=-1), sampled)
        return sampled.tolist()

    @staticmethod
    def _top_k_top_p(scaled: torch.Tensor, params: list) -> torch.Tensor:
        """Mask everything outside each row's top-k and top-p nucleus with -inf."""
        vocab = scaled.shape[-1]
        dev = scaled.device
        top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=dev)
        top_p = torch.tensor([p.top_p for p in params], device=dev)
        sorted_logits, order = scaled.sort(dim=-1, descending=True)  # (B, V)
        rank = torch.arange(vocab, device=dev)[None, :]
        drop = rank >= top_k[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # Keep a token when the mass before it is still below top_p (the top one always stays).
        drop |= (cum - torch.softmax(sorted_logits, dim=-1)) >= top_p[:, None]
        drop[:, 0] = False
        mask = torch.zeros_like(drop).scatter_(1, order, drop)
        return scaled.masked_fill(mask, float("-inf"))

    def _exponential_noise(
        self, seqs: Sequence[ScheduledSeq], shape: torch.Size, dev: torch.device
    ) -> torch.Tensor:
        noise = torch.empty(shape, device=dev)  # (B, V)
        unseeded = [i for i, s in enumerate(seqs) if s.sampling.seed is None]
        if len(unseeded) == len(seqs):
            noise.exponential_(generator=self.generator)
        elif unseeded:
            rows = torch.tensor(unseeded, device=dev)
            noise[rows] = torch.empty((len(unseeded), shape[1]), device=dev).exponential_(
                generator=self.generator
            )
        for i, s in enumerate(seqs):
            if s.sampling.seed is not None:
                g = torch.Generator(device=dev)
                g.manual_seed(_mix_seed(s.sampling.seed, s.num_generated))
                noise[i].exponential_(generator=g)
        # NOTE: a zero draw would turn a masked (prob 0) entry into 0/0 = NaN, which argmax picks.
        return noise.clamp_min_(1e-20)
