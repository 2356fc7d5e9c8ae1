"""A model runner with no model: real paged-KV plumbing, simulated forward time.

Its KV cache is a real tensor, ``(1 layer, 2, num_blocks, block_size, 1 head, 1 dim)``
float32: K holds each computed token's id and V its position + 1, written at the slot
the block table names. The token it samples for a sequence is ``next_token`` of the
token ids it READS BACK from the cache along the block table for positions
``[0, end_pos)``. A wrong block table, a bad prefix hit or a bad KV import therefore
changes the output (or trips the position check), and tests compare against
``next_token`` of the true token list: a brute-force oracle of the whole control plane.
It has no logits: penalties and logit_bias change nothing; a token ``min_tokens`` bans
(``ScheduledSeq.banned_ids``) is replaced by the next allowed id; logprobs say its token
has probability 1.

It models a device: a batch is computed at once, but its result is due
``step_base_s + per_prefill_token_s * prefill_tokens + per_decode_seq_s * decode_seqs``
seconds after the device is free (a one-token slice counts as a decode; batches run one
after the other). ``execute`` waits that out before returning; ``launch`` returns at once
and the wait happens when the result is read, so the overlapped loop shows without a GPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from collections.abc import Sequence as Seq

import numpy as np
import torch
import xxhash

from services.api.outputs import TokenLogprob
from services.common.config import EngineConfig
from services.engine.batch import PendingOutput, RunnerOutput, ScheduledBatch, ScheduledSeq
from services.engine.runner.base import KvSpec, ModelRunner, RunnerInfo
from services.engine.sampler import MIN_LOGPROB

_MOCK_SEED = 7


def mock_next_token(
    token_ids: Seq[int] | np.ndarray, vocab_size: int, eos_token_id: int, eos_probability: float
) -> int:
    """The mock model: a pure function of the whole context. eos only with the given odds."""
    h = xxhash.xxh3_64_intdigest(np.asarray(token_ids, dtype="<u4").tobytes(), seed=_MOCK_SEED)
    if eos_probability > 0 and ((h >> 40) / float(1 << 24)) < eos_probability:
        return eos_token_id
    tok = h % vocab_size
    if tok == eos_token_id and vocab_size > 1:
        tok = (tok + 1) % vocab_size
    return tok


class _MockPending:
    """A mock batch's result: computed already, due at ``due`` (perf_counter time)."""

    __slots__ = ("_out", "_due", "_sleep")

    def __init__(self, out: RunnerOutput, due: float, sleep: Callable[[float], None]) -> None:
        self._out, self._due, self._sleep = out, due, sleep

    def wait(self) -> None:
        left = self._due - time.perf_counter()
        if left > 0:
            self._sleep(left)

    def result(self) -> RunnerOutput:
        self.wait()
        return self._out


class MockRunner(ModelRunner):
    """Configured by ``cfg.mock``; ``num_kv_blocks`` and ``block_size`` size its cache."""

    supports_overlap = True
    info = RunnerInfo(device="mock")
    overlap_pays = True  # its simulated device runs while the scheduler works

    def __init__(self, cfg: EngineConfig, sleep: Callable[[float], None] = time.sleep) -> None:
        m = cfg.mock
        self.kv_spec = KvSpec(1, cfg.num_kv_blocks, cfg.block_size, 1, 1, torch.float32)
        self.vocab_size = m.vocab_size
        self.max_model_len = cfg.max_model_len or m.context_length
        self.eos_token_id = m.eos_token_id
        self.eos_probability = m.eos_probability
        self._cost = (m.step_base_s, m.per_prefill_token_s, m.per_decode_seq_s)
        self._sleep = sleep
        self.cache = torch.zeros(self.kv_spec.block_range_shape(cfg.num_kv_blocks))
        # (K|V, num_blocks * block_size), sharing memory with the tensor; numpy indexing is
        # far cheaper than torch's for these tiny per-sequence gathers.
        self._flat = self.cache.numpy().reshape(2, -1)
        positions = np.arange(self.max_model_len + 1, dtype=np.int64)
        self._block_of = positions // cfg.block_size
        self._offset_of = positions % cfg.block_size
        self._pos1 = (positions + 1).astype(np.float32)
        self.num_steps = 0
        self._future = np.zeros(0, dtype=np.int64)  # future-token map (reserve_future_slots)
        self._device_free_at = 0.0  # perf_counter time the simulated device goes idle
        self._launching = False

    def reserve_future_slots(self, n: int) -> None:
        self._future = np.zeros(n, dtype=np.int64)

    def next_token(self, token_ids: Seq[int]) -> int:
        """The oracle: what this runner samples after ``token_ids``."""
        return mock_next_token(token_ids, self.vocab_size, self.eos_token_id,
                               self.eos_probability)

    def _slots(self, table: np.ndarray, start: int, end: int) -> np.ndarray:
        """Flat cache slots of positions [start, end) along a block table."""
        if end > len(table) * self.kv_spec.block_size:
            raise RuntimeError(f"block table of {len(table)} blocks cannot hold position {end - 1}")
        return table[self._block_of[start:end]] * self.kv_spec.block_size + self._offset_of[start:end]

    def launch(self, batch: ScheduledBatch) -> PendingOutput:
        # NOTE: through ``execute`` so that subclasses wrapping it (tests gate or fail
        # steps there) behave the same in both loops; ``_launching`` defers the wait.
        self._launching = True
        try:
            out = self.execute(batch)
        finally:
            self._launching = False
        return _MockPending(out, self._device_free_at, self._sleep)

    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        sampled: list[int | None] = []
        logprobs: list[TokenLogprob | None] = []
        prompt_lps: list[list[TokenLogprob] | None] = []
        k, v = self._flat[0], self._flat[1]  # numpy views of the cache tensor
        future = self._future
        slot = batch.future_base
        prefill_tokens = decode_seqs = 0
        for s in batch.seqs:
            n = len(s.token_ids)
            if n == 1:
                decode_seqs += 1
            else:
                prefill_tokens += n
            toks = np.asarray(s.token_ids, dtype=np.int64)
            if toks[-1] < 0:  # a placeholder is always the newest token: the slice's last
                toks[-1] = future[-1 - toks[-1]]
            table = np.asarray(s.block_ids, dtype=np.int64)
            slots = self._slots(table, s.start_pos, s.end_pos)
            k[slots] = toks
            v[slots] = self._pos1[s.start_pos : s.end_pos]
            prompt_lps.append(self._prompt_logprobs(s, table) if s.prompt_targets else None)
            if not s.sample:
                sampled.append(None)
                logprobs.append(None)
                continue
            every = self._slots(table, 0, s.end_pos)
            seen = v[every]  # (end_pos,) positions + 1 as written
            want = self._pos1[: s.end_pos]
            if not np.array_equal(seen, want):
                bad = int(np.flatnonzero(seen != want)[0])
                raise RuntimeError(f"mock runner: {s.request_id!r} position {bad} reads the KV of "
                                   f"position {int(seen[bad]) - 1}: wrong block table or KV")
            tok = self.next_token(k[every].astype("<u4"))
            while tok in s.banned_ids:  # min_tokens: the next id that is allowed
                tok = (tok + 1) % self.vocab_size
            if slot < len(future):
                future[slot] = tok
            slot += 1
            sampled.append(tok)
            # The mock model is deterministic: its token has probability 1, nothing else has any.
            top = s.sampling.logprobs
            logprobs.append(None if top is None else TokenLogprob(tok, 0.0, ((tok, 0.0),)[:top]))
        self.num_steps += 1
        base, per_tok, per_seq = self._cost
        delay = base + per_tok * prefill_tokens + per_seq * decode_seqs
        # The simulated device runs one batch at a time: this one starts when it is free.
        self._device_free_at = max(time.perf_counter(), self._device_free_at) + delay
        self.busy_seconds += delay
        if not self._launching:
            _MockPending(RunnerOutput([]), self._device_free_at, self._sleep).wait()
        return RunnerOutput(sampled, logprobs if any(x is not None for x in logprobs) else None,
                            prompt_lps if any(x is not None for x in prompt_lps) else None)

    def _prompt_logprobs(self, s: ScheduledSeq, table: np.ndarray) -> list[TokenLogprob]:
        """Each target's logprob under the deterministic mock model: 0 where it is the token
        the oracle gives after the tokens before it, else MIN_LOGPROB (probability 0)."""
        known = self._flat[0][self._slots(table, 0, s.start_pos + len(s.prompt_targets))]
        out: list[TokenLogprob] = []
        for j, t in enumerate(s.prompt_targets):
            best = self.next_token(known[: s.start_pos + j + 1].astype("<u4"))
            top = ((best, 0.0),)[: s.sampling.prompt_logprobs or 0]
            out.append(TokenLogprob(t, 0.0 if t == best else MIN_LOGPROB, top))
        return out

    def export_kv(self, block_ids: Seq[int]) -> torch.Tensor:
        idx = torch.tensor(list(block_ids), dtype=torch.long)
        return self.cache[:, :, idx].clone()  # (layers, 2, n, block_size, heads, dim)

    def import_kv(self, block_ids: Seq[int], data: torch.Tensor) -> None:
        expected = self.kv_spec.block_range_shape(len(block_ids))
        if tuple(data.shape) != expected:
            raise ValueError(f"kv shape {tuple(data.shape)} != expected {expected}")
        if data.dtype != self.kv_spec.dtype:
            raise ValueError(f"kv dtype {data.dtype} != expected {self.kv_spec.dtype}")
        idx = torch.tensor(list(block_ids), dtype=torch.long)
        self.cache[:, :, idx] = data
