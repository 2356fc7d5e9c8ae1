"""Token sampling for a batch: greedy, temperature, top-k, top-p and per-request seeds.

A sampled row draws its token by inverse CDF: one uniform ``u`` per row and a
``searchsorted`` into the cumulative probabilities. Drawing a single number per row (not
noise over the whole vocabulary, which costs ~1 ms per row of a 49k vocabulary on a CPU) keeps
seeded requests cheap and reproducible: a seeded row's ``u`` comes from its own generator
seeded from ``(seed, num_generated)``, so the same request gives the same tokens whatever
else shares the batch and wherever its row is. Unseeded rows draw from one engine generator.
Uniforms are drawn on the CPU, so a seed means the same draw on every device.

Top-k/top-p work on the ``topk`` candidates of each row instead of a full vocabulary sort;
they fall back to the full sort only when a top-p row's nucleus does not fit the candidates.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from services.engine.batch import ScheduledSeq
from services.engine.request import SamplingParams

if TYPE_CHECKING:
    from services.engine.grammar.batch_mask import BatchMask

_MASK64 = (1 << 64) - 1
# Candidates examined for top-p rows without a top-k; realistic nuclei are far smaller.
TOP_P_CANDIDATES = 1024


def _mix_seed(seed: int, step: int) -> int:
    """A 63-bit generator seed from (request seed, step): the splitmix64 finaliser."""
    z = (seed * 0x9E3779B97F4A7C15 + step + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


class Sampler:
    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.generator = torch.Generator()  # CPU: see the module docstring
        self.generator.manual_seed(seed)

    def sample(self, logits: torch.Tensor, seqs: Sequence[ScheduledSeq],
               mask: BatchMask | None = None) -> list[int]:
        """logits (B, V), one row per seq in ``seqs`` -> one token id per row."""
        return self.sample_tensor(logits, seqs, mask).tolist()

    def sample_tensor(self, logits: torch.Tensor, seqs: Sequence[ScheduledSeq],
                      mask: BatchMask | None = None) -> torch.Tensor:
        """Like ``sample`` but the tokens stay on the logits' device, (B,) int64: the
        overlapped runner feeds them to the next batch without a host round trip.
        ``mask``: the grammar rows' allowed tokens (waits until it is filled); the logits
        may be modified in place."""
        if logits.shape[0] != len(seqs):
            raise ValueError(f"logits has {logits.shape[0]} rows for {len(seqs)} sequences")
        if mask is not None:
            logits = mask.apply(logits)
        params = [s.sampling for s in seqs]
        greedy_rows = [p.greedy for p in params]
        if all(greedy_rows):
            return logits.argmax(dim=-1)
        dev = logits.device
        logits = logits.float()
        # Greedy rows go through the same math with temperature 1, then take the argmax.
        temps = [1.0 if g else p.temperature for p, g in zip(params, greedy_rows, strict=True)]
        scaled = logits / torch.tensor(temps, device=dev)[:, None]  # (B, V)
        if any(not g and (p.top_k > 1 or p.top_p < 1.0) for p, g in zip(params, greedy_rows, strict=True)):
            scaled = filter_top_k_top_p(scaled, params)
        probs = torch.softmax(scaled, dim=-1)  # (B, V)
        cdf = probs.cumsum(dim=-1)  # (B, V)
        u = torch.tensor(self._uniforms(seqs), device=dev)  # (B,)
        # NOTE: the first index whose cdf exceeds u*total has positive probability, so a
        # masked token is never drawn; the clamp only guards u*total rounding up to total.
        target = (u * cdf[:, -1]).unsqueeze(1)  # (B, 1)
        sampled = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_max_(cdf.shape[1] - 1)
        if any(greedy_rows):
            sampled = torch.where(torch.tensor(greedy_rows, device=dev), logits.argmax(dim=-1), sampled)
        return sampled

    def _uniforms(self, seqs: Sequence[ScheduledSeq]) -> list[float]:
        unseeded = [i for i, s in enumerate(seqs) if s.sampling.seed is None]
        shared = torch.rand(len(unseeded), generator=self.generator, dtype=torch.float64).tolist()
        u = [0.0] * len(seqs)
        for i, x in zip(unseeded, shared, strict=True):
            u[i] = x
        for i, s in enumerate(seqs):
            if s.sampling.seed is not None:
                g = torch.Generator()
                g.manual_seed(_mix_seed(s.sampling.seed, s.num_generated + s.sampling.seed_step_offset))
                u[i] = torch.rand(1, generator=g, dtype=torch.float64).item()
        return u


def filter_top_k_top_p(scaled: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Set every logit outside its row's top-k and top-p nucleus to -inf.

    The nucleus keeps a token while the probability mass ranked before it is below top_p
    (the top token always stays); top-p applies to the top-k-renormalised distribution.
    Rows with neither filter come back unchanged.
    """
    batch, vocab = scaled.shape
    dev = scaled.device
    active = [p.top_k > 1 or p.top_p < 1.0 for p in params]
    ks = [p.top_k if p.top_k > 0 else vocab for p in params]
    p_only = any(a and p.top_k == 0 for a, p in zip(active, params, strict=True))
    n_cand = max([k for a, k in zip(active, ks, strict=True) if a and k < vocab] or [1])
    if p_only:
        n_cand = max(n_cand, TOP_P_CANDIDATES)
    n_cand = min(n_cand, vocab)
    top_k = torch.tensor(ks, device=dev)
    top_p = torch.tensor([p.top_p for p in params], device=dev)
    k_limited = top_k < vocab  # rows whose kept set lies inside the candidates by construction

    while True:
        vals, order = scaled.topk(n_cand, dim=-1)  # (B, C), sorted descending
        drop = torch.arange(n_cand, device=dev)[None, :] >= top_k[:, None]  # (B, C)
        vals = vals.masked_fill(drop, float("-inf"))
        # Normaliser: over the kept top-k, or over the whole row when there is no top-k.
        norm = torch.where(k_limited, torch.logsumexp(vals, -1), torch.logsumexp(scaled, -1))  # (B,)
        p_sorted = torch.exp(vals - norm[:, None])  # (B, C)
        cum = p_sorted.cumsum(-1)
        if n_cand < vocab and p_only:
            # The nucleus must end inside the candidates: their mass has to reach top_p.
            short = ~k_limited & (top_p < 1.0) & (cum[:, -1] < top_p)
            if bool(short.any()):
                n_cand = vocab
                continue
        break
    drop |= (cum - p_sorted) >= top_p[:, None]
    drop[:, 0] = False
    filtered = torch.full_like(scaled, float("-inf")).scatter_(1, order, vals.masked_fill(drop, float("-inf")))
    if all(active):
        return filtered
    return torch.where(torch.tensor(active, device=dev)[:, None], filtered, scaled)
