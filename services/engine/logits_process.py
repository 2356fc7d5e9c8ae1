"""Penalties, logit bias and min_tokens, applied to a batch's logits before sampling.

Only the rows whose request asks for one of them are touched: a batch where none does
costs a few Python checks and no tensor work.

Penalties need each request's token history. It stays on the device: a penalised request
owns a *penalty slot* (the scheduler draws it, ``ScheduledSeq.penalty_slot``), a row of
``counts`` (how often each token was generated) and of ``in_prompt`` (which tokens the
prompt holds, for ``repetition_penalty``). The first batch that samples for the request
carries its tokens once (``ScheduledSeq.penalty_init``) to fill the row; after that each
sampled token is added on the device (``record``), so no step copies a history from the
host -- the overlapped runner's next batch sees the count of a token it never read back.
A slot is reused only after its request finished; the batch that reuses it resets the row
first, and batches run in launch order, so a late ``record`` of the old owner lands before.

vLLM's and OpenAI's meaning: ``logits -= frequency * count + presence * (count > 0)``;
a token in the prompt or generated has its logit divided by ``repetition_penalty`` when
positive, multiplied when negative; ``logit_bias`` is added; until ``min_tokens`` tokens
were produced, EOS and the stop token ids (``ScheduledSeq.banned_ids``) are -inf.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.engine.batch import ScheduledSeq


class LogitsProcessor:
    """Device state of the penalty slots, and the per-step logits rules."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.counts = torch.zeros(0, 0, dtype=torch.int32, device=device)  # (slots, V)
        self.in_prompt = torch.zeros(0, 0, dtype=torch.bool, device=device)  # (slots, V)

    def _ensure(self, slot: int, vocab: int) -> None:
        n = self.counts.shape[0]
        if slot < n and self.counts.shape[1] == vocab:
            return
        grow = max(slot + 1, 2 * n, 8)
        counts = torch.zeros(grow, vocab, dtype=torch.int32, device=self.device)
        in_prompt = torch.zeros(grow, vocab, dtype=torch.bool, device=self.device)
        if n and self.counts.shape[1] == vocab:
            counts[:n] = self.counts
            in_prompt[:n] = self.in_prompt
        self.counts, self.in_prompt = counts, in_prompt

    def _init_slots(self, seqs: Sequence[ScheduledSeq], vocab: int) -> None:
        for s in seqs:
            init = s.penalty_init
            if init is None:
                continue
            self._ensure(s.penalty_slot, vocab)
            row = s.penalty_slot
            self.counts[row].zero_()
            self.in_prompt[row].zero_()
            if init.prompt_ids:
                self.in_prompt[row, torch.tensor(init.prompt_ids, device=self.device)] = True
            if init.output_ids:
                ids = torch.tensor(init.output_ids, device=self.device)
                self.counts[row].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))

    def apply(self, logits: torch.Tensor, seqs: Sequence[ScheduledSeq]) -> torch.Tensor:
        """logits (B, V) float32 -> the processed logits (a new tensor when any rule
        applies, else ``logits`` itself)."""
        rows = [i for i, s in enumerate(seqs) if s.sampling.processes_logits or s.banned_ids]
        if not rows:
            return logits
        dev = logits.device
        vocab = logits.shape[1]
        logits = logits.to(torch.float32, copy=True)
        pen = [i for i in rows if seqs[i].sampling.penalized]
        if pen:
            self._init_slots([seqs[i] for i in pen], vocab)
            idx = torch.tensor(pen, device=dev)
            slots = torch.tensor([seqs[i].penalty_slot for i in pen], device=dev)
            ps = [seqs[i].sampling for i in pen]
            counts = self.counts[slots].float()  # (P, V)
            sub = logits[idx]  # (P, V)
            seen = self.in_prompt[slots] | (counts > 0)
            rep = torch.tensor([p.repetition_penalty for p in ps], device=dev)[:, None]
            sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
            freq = torch.tensor([p.frequency_penalty for p in ps], device=dev)[:, None]
            pres = torch.tensor([p.presence_penalty for p in ps], device=dev)[:, None]
            sub = sub - freq * counts - pres * (counts > 0).float()
            logits[idx] = sub
        bias_rows: list[int] = []
        bias_ids: list[int] = []
        bias_vals: list[float] = []
        ban_rows: list[int] = []
        ban_ids: list[int] = []
        for i in rows:
            s = seqs[i]
            for t, b in s.sampling.logit_bias:
                bias_rows.append(i)
                bias_ids.append(t)
                bias_vals.append(b)
            for t in s.banned_ids:
                ban_rows.append(i)
                ban_ids.append(t)
        if bias_rows:
            logits.index_put_((torch.tensor(bias_rows, device=dev), torch.tensor(bias_ids, device=dev)),
                              torch.tensor(bias_vals, device=dev), accumulate=True)
        if ban_rows:
            logits[torch.tensor(ban_rows, device=dev), torch.tensor(ban_ids, device=dev)] = float("-inf")
        return logits

    def record(self, tokens: torch.Tensor, seqs: Sequence[ScheduledSeq]) -> None:
        """Count the tokens just sampled ((B,) on the device) for the penalised rows."""
        pen = [i for i, s in enumerate(seqs) if s.sampling.penalized]
        if not pen:
            return
        dev = tokens.device
        slots = torch.tensor([seqs[i].penalty_slot for i in pen], device=dev)
        toks = tokens[torch.tensor(pen, device=dev)]
        self.counts.index_put_((slots, toks), torch.ones_like(toks, dtype=torch.int32), accumulate=True)
