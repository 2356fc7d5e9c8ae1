"""The simulator's inputs: traces and bench workloads as ``SimRequest`` lists, the window
and sample of a trace a run replays, the tokens of a trace request, and the hit rate an
infinite shared prefix cache would reach on them.

Two trace formats: Mooncake JSON lines (``timestamp`` ms, ``input_length``,
``output_length``, ``hash_ids`` of 512-token blocks) and the Azure LLM inference CSV
(``TIMESTAMP,ContextTokens,GeneratedTokens``; no prefix information, so every prompt is
unique). A bench workload (``from_bench``) keeps its prompts, so a calibration replays
exactly the tokens ``tandem bench serve`` sends a real cluster.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Literal

import numpy as np

from services.bench.arrivals import schedule
from services.bench.workloads import ID_HIGH, ID_LOW, MOONCAKE_BLOCK_TOKENS, BenchRequest
from services.common.hashing import local_block_hashes, seq_hashes
from services.sim.requests import SimRequest

TraceFormat = Literal["auto", "mooncake", "azure"]
_AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


# ---- loading -------------------------------------------------------------------------
def load_trace(path: str | Path, fmt: TraceFormat = "auto") -> list[SimRequest]:
    """Every request of a trace file, in file order (``index`` counts them from 0).

    ``auto`` reads the first non-blank line: a JSON object is Mooncake, a header naming
    the Azure columns is Azure; an empty file is read by its suffix. Raises ValueError
    naming ``file:line`` for a row that is not a request of the format."""
    path = Path(path)
    if fmt == "auto":
        fmt = _detect(path)
    if fmt == "mooncake":
        return _mooncake(path)
    if fmt == "azure":
        return _azure(path)
    raise ValueError(f"load_trace: unknown format {fmt!r} (mooncake, azure or auto)")


def _detect(path: Path) -> Literal["mooncake", "azure"]:
    with open(path) as f:
        first = next((line.strip() for line in f if line.strip()), "")
    if first.startswith("{"):
        return "mooncake"
    if all(c in first.split(",") for c in _AZURE_COLUMNS):
        return "azure"
    if not first and path.suffix in (".jsonl", ".json", ".csv"):
        return "azure" if path.suffix == ".csv" else "mooncake"
    raise ValueError(f"{path}: not a Mooncake JSONL or Azure CSV trace (first line {first[:60]!r})")


def _mooncake(path: Path) -> list[SimRequest]:
    out: list[SimRequest] = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                ts = row["timestamp"]
                if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts):
                    raise ValueError(f"timestamp must be a number, got {ts!r}")
                n_in, n_out = _count(row, "input_length"), _count(row, "output_length")
                ids = row["hash_ids"]
                if not isinstance(ids, list) or not all(type(h) is int and h >= 0 for h in ids):
                    raise ValueError("hash_ids must be a list of ints >= 0")
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{path}:{lineno}: not a Mooncake trace row ({_why(e)})") from None
            out.append(SimRequest(len(out), ts / 1000.0, n_in, n_out, tuple(ids) or None,
                                  MOONCAKE_BLOCK_TOKENS))
    return out


def _azure(path: Path) -> list[SimRequest]:
    out: list[SimRequest] = []
    t0: datetime | None = None
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames is None:  # an empty file
            return out
        missing = [c for c in _AZURE_COLUMNS if c not in (reader.fieldnames or ())]
        if missing:
            raise ValueError(f"{path}:1: not an Azure trace header (no {', '.join(missing)})")
        for lineno, row in enumerate(reader, 2):
            try:
                t = _azure_time(row["TIMESTAMP"])
                n_in, n_out = _count(row, "ContextTokens"), _count(row, "GeneratedTokens")
                t0 = t0 or t
                arrival = (t - t0).total_seconds()
                if arrival < 0:
                    raise ValueError("earlier than the first row")
            except (TypeError, ValueError, AttributeError) as e:
                raise ValueError(f"{path}:{lineno}: not an Azure trace row ({_why(e)})") from None
            out.append(SimRequest(len(out), arrival, n_in, n_out))
    return out


def _azure_time(stamp: str) -> datetime:
    # NOTE: the traces write 7 fractional digits; fromisoformat takes at most 6.
    head, _, frac = stamp.strip().partition(".")
    return datetime.fromisoformat(f"{head}.{(frac + '000000')[:6]}")


def _count(row: dict, key: str) -> int:
    v = row.get(key)
    n = int(v) if isinstance(v, str) else v
    if type(n) is not int or n < 1:
        raise ValueError(f"{key} must be an integer >= 1, got {v!r}")
    return n


def _why(e: Exception) -> str:
    return f"no field {e}" if isinstance(e, KeyError) else str(e)


# ---- bench workloads -----------------------------------------------------------------
def from_bench(reqs: Sequence[BenchRequest], send_s: Sequence[float]) -> list[SimRequest]:
    """The first ``len(send_s)`` requests of a bench workload, sent at ``send_s`` (what
    ``services.bench.arrivals.schedule`` gives it), with their prompts and ``after``."""
    if len(send_s) > len(reqs):
        raise ValueError(f"from_bench: {len(send_s)} send times for {len(reqs)} requests")
    out = []
    for i, (r, t) in enumerate(zip(reqs, send_s, strict=False)):
        if r.index != i:
            raise ValueError(f"from_bench: request {i} has index {r.index}")
        out.append(SimRequest(i, float(t), r.prompt_len, r.output_len, prompt=r.prompt_ids,
                              after=r.after))
    return out


def bench_workload(args: argparse.Namespace) -> list[SimRequest]:
    """The workload and send times ``tandem bench serve`` would use with ``args`` (the
    options of ``services.bench.args.add_workload_args``)."""
    # NOTE: imported here: serve brings the bench's HTTP client, which a replay never uses.
    from services.bench.serve import arrival_spec, build_workload

    reqs = build_workload(args)[: args.num_requests]
    send = schedule(arrival_spec(args), len(reqs), args.duration, [r.arrival_s for r in reqs])
    if send is None:
        raise ValueError("sim: --arrival concurrency is not supported (a closed loop has no "
                         "send times to replay); use poisson, gamma or trace")
    return from_bench(reqs, send)


# ---- selection -----------------------------------------------------------------------
def select(reqs: Sequence[SimRequest], *, speedup: float = 1.0, start_s: float | None = None,
           end_s: float | None = None, sample_mod: int | None = None,
           limit: int | None = None) -> list[SimRequest]:
    """The part of a trace a run replays, in arrival order, indices renumbered from 0.

    In this order: the window ``[start_s, end_s)`` of the trace's own clock, shifted so
    that ``start_s`` is 0; whole conversations, the requests whose ``hash_ids[1] %
    sample_mod == 0`` (those with fewer than two ids dropped: Dynamo's ``--sample-mod``
    rule); arrival times divided by ``speedup``; the first ``limit`` requests. ``after``
    follows its target's new index, or becomes None when the target was cut."""
    if not speedup > 0:
        raise ValueError(f"select: speedup must be > 0, got {speedup}")
    if sample_mod is not None and sample_mod < 1:
        raise ValueError(f"select: sample_mod must be >= 1, got {sample_mod}")
    if limit is not None and limit < 0:
        raise ValueError(f"select: limit must be >= 0, got {limit}")
    if start_s is not None and end_s is not None and end_s <= start_s:
        raise ValueError(f"select: end_s ({end_s}) must be after start_s ({start_s})")
    lo = -math.inf if start_s is None else start_s
    hi = math.inf if end_s is None else end_s
    base = start_s or 0.0
    kept = [r for r in reqs if lo <= r.arrival_s < hi and (
        sample_mod is None or (r.hash_ids is not None and len(r.hash_ids) >= 2
                               and r.hash_ids[1] % sample_mod == 0))]
    kept.sort(key=lambda r: (r.arrival_s, r.index))
    kept = kept[:limit]
    new = {r.index: i for i, r in enumerate(kept)}
    return [replace(r, index=i, arrival_s=(r.arrival_s - base) / speedup,
                    after=None if r.after is None else new.get(r.after))
            for i, r in enumerate(kept)]


# ---- prompt tokens -------------------------------------------------------------------
_U64 = np.uint64
_GOLDEN = _U64(0x9E3779B97F4A7C15)
_ID_SPAN = np.uint32(ID_HIGH - ID_LOW)
_SHIFT = np.uint32(16)
# NOTE: every token id below ID_HIGH as one shared int: a prompt's list is gathered from
# these (pointer copies: a third faster than ``tolist`` making, and later freeing, 12k ints).
_INTS = np.array(range(ID_HIGH), dtype=object)


def token_list(tokens: np.ndarray) -> list[int]:
    """A made prompt (``PromptMaker.make``: ids below ID_HIGH) as the engine's list of ints."""
    return _INTS.take(tokens).tolist()


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, a bijection of uint64 (so distinct ids get distinct keys)."""
    z = z + _GOLDEN
    z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
    return z ^ (z >> _U64(31))


class PromptMaker:
    """The prompt tokens of a replayed request, made when it arrives.

    ``req.prompt`` when it has one. Otherwise each hash id becomes ``trace_block`` tokens
    that depend on the id and the seed alone (equal ids, equal tokens in every request
    and run; different ids get distinct 64-bit keys, and their blocks agree at any one
    position only by a 1/29000 chance), concatenated and cut to ``input_len``;
    what the ids do not cover, and the whole prompt of a request without ids, is tokens
    unique to the request (keyed by its index). Ids lie in ``[ID_LOW, ID_HIGH)``.

    NOTE: no cache: a block's tokens are a counter-based hash of (id key, position),
    computed for a whole prompt in a few numpy passes (about as fast as copying a cached
    block), so memory stays flat however many distinct ids a trace holds. Token j of a
    block with key k = (k_lo, k_hi) is the top bits of ``k_lo * P[j] + k_hi * Q[j]`` (mod
    2^32) scaled into the id range, with P, Q fixed odd multipliers.
    """

    def __init__(self, seed: int = 0) -> None:
        if seed < 0:
            raise ValueError(f"PromptMaker: seed must be >= 0, got {seed}")
        salts = _mix(np.array([2 * seed, 2 * seed + 1], dtype=_U64))
        self._id_salt, self._pad_salt = salts[:1], salts[1:]
        self._tables: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def tokens(self, req: SimRequest) -> list[int]:
        made = self.make(req)
        return made if isinstance(made, list) else token_list(made)

    def make(self, req: SimRequest) -> list[int] | np.ndarray:
        """``tokens`` as they are made: a trace request's as a u32 array (hashed as it is,
        with no list to pack; the simulator makes the engine's list of it once), a request's
        own ``prompt`` as a list."""
        if req.prompt is not None:
            return list(req.prompt)
        n, block = req.input_len, req.trace_block
        rows = -(-n // block)
        ids = req.hash_ids or ()
        k = min(len(ids), rows)
        keys = np.empty(rows, dtype=_U64)
        if k:
            keys[:k] = _mix(np.array(ids[:k], dtype=_U64) ^ self._id_salt)
        if k < rows:  # NOTE: keyed apart from every id (another salt): never a shared prefix
            own = _mix(np.array([req.index], dtype=_U64) ^ self._pad_salt)
            keys[k:] = _mix(own + np.arange(k, rows, dtype=_U64) * _GOLDEN)
        p, q = self._table(block)
        lo = (keys & _U64(0xFFFFFFFF)).astype(np.uint32)[:, None]
        hi = (keys >> _U64(32)).astype(np.uint32)[:, None]
        x = lo * p  # (rows, block)
        x += hi * q
        x >>= _SHIFT
        x *= _ID_SPAN  # < 2^16 * 29000 < 2^32: no wrap
        x >>= _SHIFT
        x += np.uint32(ID_LOW)
        return x.ravel()[:n]

    def _table(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        t = self._tables.get(block)
        if t is None:
            rng = np.random.default_rng(0x7A4DE)
            p, q = (rng.integers(0, 1 << 32, size=block, dtype=np.uint32) | np.uint32(1)
                    for _ in range(2))
            t = self._tables[block] = (p, q)
        return t


# ---- the infinite-cache oracle -------------------------------------------------------
def oracle_hit_rate(reqs: Sequence[SimRequest], block_size: int,
                    maker: PromptMaker | None = None) -> float:
    """Share of prompt tokens an infinite shared prefix cache would serve, the requests in
    arrival order, each hit capped at ``(input_len - 1) // block_size`` blocks as
    ``KvCacheManager.match_prefix`` caps it; every full block of a prompt is cached.

    Requests with hash ids and ``trace_block % block_size == 0`` are matched on their id
    chains (equal chains are equal token prefixes by ``PromptMaker``'s construction, down
    to a partial last block); others with ids on ``maker``'s tokens; requests with a
    ``prompt`` on it. A request with neither hits nothing."""
    if block_size < 1:
        raise ValueError(f"oracle_hit_rate: block_size must be >= 1, got {block_size}")
    maker = maker or PromptMaker()
    chains = _ChainCache(block_size)
    seen: set[int] = set()
    hit = total = 0
    for r in sorted(reqs, key=lambda r: (r.arrival_s, r.index)):
        total += r.input_len
        cap = (r.input_len - 1) // block_size
        if r.prompt is None and r.hash_ids and r.trace_block % block_size == 0:
            hit += min(chains.match_and_insert(r.hash_ids, r.input_len, r.trace_block), cap) * block_size
        elif r.prompt is not None or r.hash_ids:
            hashes = seq_hashes(local_block_hashes(maker.make(r), block_size))
            n = 0
            while n < min(len(hashes), cap) and hashes[n] in seen:
                n += 1
            hit += n * block_size
            seen.update(hashes)
    return hit / total if total else 0.0


class _ChainCache:
    """An infinite prefix cache keyed by hash-id chains: a trie node per chain, holding
    how many leading engine blocks of its trace block some request has computed."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.nodes: dict[tuple[int, int], int] = {}  # (parent node, hash id) -> node
        self.covered: list[int] = [0]  # per node; node 0 is the root

    def match_and_insert(self, ids: Sequence[int], input_len: int, trace_block: int) -> int:
        """Engine blocks of this request's prefix already cached; then caches its own."""
        per = trace_block // self.block_size
        full = input_len // self.block_size  # the request's full engine blocks
        hit, matching, node = 0, True, 0
        for t, h in enumerate(ids):
            need = min(per, full - t * per)
            if need <= 0:
                break
            child = self.nodes.get((node, h))
            if child is None:
                child = self.nodes[(node, h)] = len(self.covered)
                self.covered.append(0)
            if matching:
                got = min(self.covered[child], need)
                hit += got
                matching = got == need
            self.covered[child] = max(self.covered[child], need)
            node = child
        return hit
