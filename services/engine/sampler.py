"""Token sampling for a batch: greedy, temperature, min-p, top-k, top-p and per-request seeds.

A sampled row draws its token by inverse CDF: one uniform ``u`` per row and a
``searchsorted`` into the cumulative probabilities. Drawing a single number per row (not
noise over the whole vocabulary, which costs ~1 ms per row of a 49k vocabulary on a CPU) keeps
seeded requests cheap and reproducible: a seeded row's ``u`` comes from its own generator
seeded from ``(seed, num_generated + seed_step_offset)``, where choice ``i`` of an n > 1
request carries ``choice_seed(seed, i)`` (SamplingParams.for_choice), so the draw is keyed by
(seed, choice, position): the same request gives the same tokens whatever else shares the
batch, wherever its row is, and however its prompt was computed (a prefix hit, chunks, a
remote prefill). The logits themselves may still differ there (docs/engine.md). Unseeded rows draw from one engine generator.
Uniforms are drawn on the CPU, so a seed means the same draw on every device.

One step's pipeline (``sample_tensor``), in this order:

1. the logits rules of logits_process.py (penalties, logit_bias, min_tokens);
2. the structured-output grammar mask;
3. logprobs, from these processed logits (before temperature: what the model, as
   constrained, says of each token);
4. temperature, min-p, top-k/top-p and the draw.

Top-k/top-p work on the ``topk`` candidates of each row instead of a full vocabulary sort;
they fall back to the full sort only when a top-p row's nucleus does not fit the candidates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from services.api.outputs import TokenLogprob
from services.api.sampling import SamplingParams
from services.engine.batch import ScheduledSeq
from services.engine.logits_process import LogitsProcessor

if TYPE_CHECKING:
    from services.engine.grammar.batch_mask import BatchMask

_MASK64 = (1 << 64) - 1
# The logprob reported for a token that cannot be drawn (-inf: banned by min_tokens or a
# grammar): JSON has no infinity, and OpenAI clients parse a number (vLLM's choice too).
MIN_LOGPROB = -9999.0
# Candidates examined for top-p rows without a top-k; realistic nuclei are far smaller.
TOP_P_CANDIDATES = 1024


def _mix_seed(seed: int, step: int) -> int:
    """A 63-bit generator seed from (request seed, step): the splitmix64 finaliser."""
    z = (seed * 0x9E3779B97F4A7C15 + step + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


@dataclass(slots=True)
class Sampled:
    """A batch's draw, on the logits' device. With logprobs (some row asked for them):
    ``logprob`` (B,) of each drawn token, ``top_ids``/``top_logprobs`` (B, K) with K the
    largest ``logprobs`` asked in the batch; rows that did not ask are computed anyway."""

    tokens: torch.Tensor  # (B,) int64
    logprob: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None

    def to_host(self, non_blocking: bool = False) -> Sampled:
        """A copy on the CPU (``non_blocking``: the caller syncs before reading it)."""
        def cpu(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to("cpu", non_blocking=non_blocking)
        return Sampled(cpu(self.tokens), cpu(self.logprob), cpu(self.top_ids),  # type: ignore[arg-type]
                       cpu(self.top_logprobs))

    def token_logprobs(self, seqs: Sequence[ScheduledSeq]) -> list[TokenLogprob | None] | None:
        """Per row, the TokenLogprob of a row that asked (host tensors only), else None."""
        if self.logprob is None:
            return None
        assert self.top_ids is not None and self.top_logprobs is not None
        toks = self.tokens.tolist()
        lps = self.logprob.clamp(min=MIN_LOGPROB).tolist()
        top_ids = self.top_ids.tolist()
        top_lps = self.top_logprobs.clamp(min=MIN_LOGPROB).tolist()
        out: list[TokenLogprob | None] = []
        for i, s in enumerate(seqs):
            k = s.sampling.logprobs
            if k is None:
                out.append(None)
                continue
            out.append(TokenLogprob(toks[i], lps[i], tuple(zip(top_ids[i][:k], top_lps[i][:k], strict=True))))
        return out


class Sampler:
    """``row_invariant``: draw each sampled row in its own call, so that every reduction and
    scan of the draw (CUDA's cumsum and logsumexp pick their split from the row count) sees
    one row, and a row's draw is the same bits in any batch (engine.deterministic on CUDA)."""

    def __init__(self, seed: int = 0, device: torch.device | str = "cpu", row_invariant: bool = False) -> None:
        self.device = torch.device(device)
        self.row_invariant = row_invariant
        self.generator = torch.Generator()  # CPU: see the module docstring
        self.generator.manual_seed(seed)
        self.processor = LogitsProcessor(self.device)

    def sample(self, logits: torch.Tensor, seqs: Sequence[ScheduledSeq],
               mask: BatchMask | None = None) -> list[int]:
        """logits (B, V), one row per seq in ``seqs`` -> one token id per row."""
        return self.sample_tensor(logits, seqs, mask).tokens.tolist()

    def sample_tensor(self, logits: torch.Tensor, seqs: Sequence[ScheduledSeq],
                      mask: BatchMask | None = None) -> Sampled:
        """The module docstring's pipeline; the result stays on the logits' device: the
        overlapped runner feeds the tokens to the next batch without a host round trip.
        ``mask``: the grammar rows' allowed tokens (waits until it is filled); the logits
        may be modified in place."""
        if logits.shape[0] != len(seqs):
            raise ValueError(f"logits has {logits.shape[0]} rows for {len(seqs)} sequences")
        logits = self.processor.apply(logits, seqs)
        if mask is not None:
            logits = mask.apply(logits)
        k = max((s.sampling.logprobs for s in seqs if s.sampling.logprobs is not None), default=-1)
        if self.row_invariant and len(seqs) > 1 and not all(s.sampling.greedy for s in seqs):
            tokens = torch.cat([self._draw(logits[i : i + 1], seqs[i : i + 1]) for i in range(len(seqs))])
        else:
            tokens = self._draw(logits, seqs)
        out = Sampled(tokens)
        if k >= 0:
            logp = torch.log_softmax(logits.float(), dim=-1)  # (B, V)
            out.logprob = logp.gather(1, tokens[:, None]).squeeze(1)
            out.top_logprobs, out.top_ids = logp.topk(k, dim=-1) if k else (
                logp[:, :0], tokens[:, None][:, :0])
        self.processor.record(tokens, seqs)
        return out

    def _draw(self, logits: torch.Tensor, seqs: Sequence[ScheduledSeq]) -> torch.Tensor:
        """Temperature, min-p, top-k/top-p and the draw: (B,) int64 on the logits' device."""
        params = [s.sampling for s in seqs]
        greedy_rows = [p.greedy for p in params]
        if all(greedy_rows):
            return greedy(logits)
        dev = logits.device
        logits = logits.float()
        # Greedy rows go through the same math with temperature 1, then take the argmax.
        temps = [1.0 if g else p.temperature for p, g in zip(params, greedy_rows, strict=True)]
        scaled = logits / torch.tensor(temps, device=dev)[:, None]  # (B, V)
        if any(not g and p.min_p > 0 for p, g in zip(params, greedy_rows, strict=True)):
            scaled = filter_min_p(scaled, params)
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
            sampled = torch.where(torch.tensor(greedy_rows, device=dev), greedy(logits), sampled)
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


def prompt_token_logprobs(logits: torch.Tensor, targets: Sequence[int], k: int
                          ) -> list[TokenLogprob]:
    """logits (n, V) at n consecutive prompt positions -> the logprob of the prompt token
    that follows each (``targets``, n of them) and the ``k`` most likely tokens', from the
    model's own logits (no penalties, bias, grammar or temperature: what the model says of
    the prompt, as vLLM's prompt logprobs)."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # (n, V)
    tgt = torch.tensor(list(targets), dtype=torch.int64, device=logits.device)
    chosen = logp.gather(1, tgt[:, None]).squeeze(1).clamp(min=MIN_LOGPROB).tolist()
    if k:
        top_v, top_i = logp.topk(k, dim=-1)  # (n, k)
        vals, ids = top_v.clamp(min=MIN_LOGPROB).tolist(), top_i.tolist()
    else:
        vals = ids = [[] for _ in chosen]
    return [TokenLogprob(t, c, tuple(zip(i, v, strict=True)))
            for t, c, i, v in zip(targets, chosen, ids, vals, strict=True)]


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the first index of its largest value), (B,) int64."""
    # NOTE: max's indices, not argmax: on CPU torch's argmax over bfloat16 is a scalar
    # reduce, ~4x slower than max (2.8 against 0.7 ms for 32 rows of SmolLM2's 49,152
    # logits, about 5% of a 32-row decode step); both give the first maximum and NaN alike.
    return logits.max(dim=-1).indices


def filter_min_p(scaled: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Set every logit whose probability is below its row's ``min_p`` times the row's
    largest probability to -inf (a row with min_p 0 keeps every token).

    NOTE: p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p): no softmax needed.
    """
    min_p = torch.tensor([p.min_p for p in params], device=scaled.device)  # (B,)
    threshold = scaled.amax(dim=-1) + torch.log(min_p)  # (B,); min_p 0 -> -inf
    return scaled.masked_fill(scaled < threshold[:, None], float("-inf"))


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
