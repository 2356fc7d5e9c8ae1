"""Benchmark workloads: lists of requests with token-id prompts, built deterministically.

Every prompt is a list of token ids (sent as-is to ``/v1/completions``, or rendered as text
for chat by ``render_text``), so prefix sharing is exact: two requests share a KV prefix
exactly when their id lists share a prefix, and the infinite-cache oracle
(``oracle_hit_rate``) can be computed from the workload itself.

Token ids are drawn from ``[ID_LOW, ID_HIGH)``: clear of the special tokens at the bottom
of SmolLM2's (and most) vocabularies and inside any vocabulary of >= 32k entries.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

from services.common.hashing import local_block_hashes, seq_hashes

ID_LOW, ID_HIGH = 1_000, 30_000
MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload.

    ``arrival_s``: the trace's send time (seconds from the first request), None when the
    arrival process decides. ``after``: index of the request that must finish before this
    one is sent (the previous turn of a conversation), or None.
    """

    index: int
    prompt_ids: tuple[int, ...]
    output_len: int
    arrival_s: float | None = None
    after: int | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


def _ids(rng: np.random.Generator, n: int) -> tuple[int, ...]:
    return tuple(int(x) for x in rng.integers(ID_LOW, ID_HIGH, size=n))


def shared_prefix(num_groups: int, prompts_per_group: int, system_len: int, question_len: int,
                  output_len: int, seed: int = 0) -> list[BenchRequest]:
    """``num_groups`` system prompts of ``system_len`` tokens, each followed by
    ``prompts_per_group`` distinct questions of ``question_len`` tokens; order shuffled."""
    for name, v in (("num_groups", num_groups), ("prompts_per_group", prompts_per_group),
                    ("question_len", question_len), ("output_len", output_len)):
        if v < 1:
            raise ValueError(f"shared_prefix: {name} must be >= 1, got {v}")
    if system_len < 0:
        raise ValueError(f"shared_prefix: system_len must be >= 0, got {system_len}")
    rng = np.random.default_rng(seed)
    systems = [_ids(rng, system_len) for _ in range(num_groups)]
    prompts = [systems[g] + _ids(rng, question_len)
               for g in range(num_groups) for _ in range(prompts_per_group)]
    order = rng.permutation(len(prompts))
    return [BenchRequest(i, prompts[j], output_len) for i, j in enumerate(order)]


def multi_turn(num_conversations: int, turns: int, system_len: int, user_len: int,
               assistant_len: int, output_len: int, seed: int = 0) -> list[BenchRequest]:
    """Conversations that resend their history: turn k's prompt is the system prompt and
    every earlier user and (synthetic, fixed) assistant message, then a new user message.
    Turn k of a conversation waits for turn k-1 (``after``); conversations interleave."""
    if num_conversations < 1 or turns < 1:
        raise ValueError("multi_turn: num_conversations and turns must be >= 1")
    rng = np.random.default_rng(seed)
    out: list[BenchRequest] = []
    histories = [_ids(rng, system_len) for _ in range(num_conversations)]
    last: list[int | None] = [None] * num_conversations
    for _ in range(turns):
        for c in range(num_conversations):
            prompt = histories[c] + _ids(rng, user_len)
            out.append(BenchRequest(len(out), prompt, output_len, after=last[c]))
            last[c] = len(out) - 1
            histories[c] = prompt + _ids(rng, assistant_len)
    return out


def _block_ids(hash_id: int, n: int, seed: int) -> tuple[int, ...]:
    # NOTE: seeded by (seed, hash_id) alone, so the same id yields the same tokens in every
    # request and every run: equal ids share a prefix.
    return _ids(np.random.default_rng([seed, hash_id]), n)


def mooncake(path: str | Path, scale: float = 1 / 32, output_scale: float | None = None,
             limit: int | None = None, seed: int = 0) -> list[BenchRequest]:
    """Replay a Mooncake trace (JSON lines: timestamp ms, input_length, output_length,
    hash_ids of 512-token blocks). Each hash id becomes ``round(512 * scale)`` fixed tokens;
    a prompt is its blocks' tokens cut to ``round(input_length * scale)``."""
    if not 0 < scale <= 1:
        raise ValueError(f"mooncake: scale must be in (0, 1], got {scale}")
    oscale = scale if output_scale is None else output_scale
    block = max(1, round(MOONCAKE_BLOCK_TOKENS * scale))
    cache: dict[int, tuple[int, ...]] = {}
    out: list[BenchRequest] = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                ts, n_in, n_out = float(row["timestamp"]), int(row["input_length"]), int(row["output_length"])
                hash_ids = [int(h) for h in row["hash_ids"]]
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{path}:{lineno}: not a Mooncake trace row ({e})") from None
            n = max(1, round(n_in * scale))
            prompt: list[int] = []
            for h in hash_ids:
                if len(prompt) >= n:
                    break
                if h not in cache:
                    cache[h] = _block_ids(h, block, seed)
                prompt.extend(cache[h])
            if len(prompt) < n:  # a row whose ids cover less than its length: pad uniquely
                prompt.extend(_ids(np.random.default_rng([seed, 1 << 40, lineno]), n - len(prompt)))
            out.append(BenchRequest(len(out), tuple(prompt[:n]), max(1, round(n_out * oscale)),
                                    arrival_s=ts / 1000.0))
    return out


def azure(path: str | Path, scale: float = 1 / 8, output_scale: float | None = None,
          limit: int | None = None, seed: int = 0) -> list[BenchRequest]:
    """Replay an Azure LLM inference trace CSV (TIMESTAMP, ContextTokens, GeneratedTokens):
    arrival times and scaled lengths; prompts are unique random ids (the trace has no
    prefix information)."""
    if not 0 < scale <= 1:
        raise ValueError(f"azure: scale must be in (0, 1], got {scale}")
    oscale = scale if output_scale is None else output_scale
    rng = np.random.default_rng(seed)
    out: list[BenchRequest] = []
    t0: datetime | None = None
    with open(path, newline="") as f:
        for lineno, row in enumerate(csv.DictReader(f), 2):
            if limit is not None and len(out) >= limit:
                break
            try:
                # NOTE: 7 fractional digits: fromisoformat wants at most 6 before 3.11.
                stamp = row["TIMESTAMP"].strip()
                head, _, frac = stamp.partition(".")
                t = datetime.fromisoformat(f"{head}.{(frac + '000000')[:6]}")
                n_in, n_out = int(row["ContextTokens"]), int(row["GeneratedTokens"])
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                raise ValueError(f"{path}:{lineno}: not an Azure trace row ({e})") from None
            t0 = t0 or t
            out.append(BenchRequest(len(out), _ids(rng, max(1, round(n_in * scale))),
                                    max(1, round(n_out * oscale)),
                                    arrival_s=(t - t0).total_seconds()))
    return out


def mixed_lengths(num_requests: int, short_len: int, long_len: int, long_fraction: float,
                  output_len: int, seed: int = 0) -> list[BenchRequest]:
    """Unique prompts, a ``long_fraction`` share of them ``long_len`` tokens and the rest
    ``short_len``: the disaggregation workload (long prefills stall co-running decodes)."""
    if not 0 <= long_fraction <= 1:
        raise ValueError(f"mixed_lengths: long_fraction must be in [0, 1], got {long_fraction}")
    rng = np.random.default_rng(seed)
    is_long = rng.random(num_requests) < long_fraction
    return [BenchRequest(i, _ids(rng, long_len if lg else short_len), output_len)
            for i, lg in enumerate(is_long)]


def shifted_ids(requests: Sequence[BenchRequest], shift: int) -> list[BenchRequest]:
    """The same requests with every token id moved by ``shift`` (mod the id range): equal
    ids stay equal and distinct ones distinct, so lengths, order, arrivals and the prefix
    sharing *within* the list are kept, while a cache warmed by the unshifted list almost
    never matches a block (a rate sweep's rates share one cluster, and its prefix cache)."""
    span = ID_HIGH - ID_LOW
    return [BenchRequest(r.index, tuple(ID_LOW + (i - ID_LOW + shift) % span for i in r.prompt_ids),
                         r.output_len, r.arrival_s, r.after) for r in requests]


def oracle_hit_rate(prompts: Sequence[Sequence[int]], block_size: int) -> float:
    """Share of prompt tokens an infinite prefix cache would hit, sending ``prompts`` in
    order: each prompt's leading full blocks already computed by an earlier prompt."""
    seen: set[int] = set()
    hit = total = 0
    for p in prompts:
        total += len(p)
        hashes = seq_hashes(local_block_hashes(p, block_size))
        n = 0
        while n < len(hashes) and hashes[n] in seen:
            n += 1
        hit += n * block_size
        seen.update(hashes)
    return hit / total if total else 0.0


_WORDS = ("time year people way day man thing woman life child world school state family "
          "student group country problem hand part place case week company system program "
          "question work government number night point home water room mother area money "
          "story fact month lot right study book eye job word business issue side kind head "
          "house service friend father power hour game line end member law car city name").split()


def render_text(prompt_ids: Sequence[int]) -> str:
    """A chat-endpoint rendering of a prompt: one common word per id, so equal id
    prefixes give equal text prefixes (token counts then differ from ``len(prompt_ids)``)."""
    return " ".join(_WORDS[i % len(_WORDS)] for i in prompt_ids)
