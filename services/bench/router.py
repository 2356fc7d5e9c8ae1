"""`tandem bench router`: route latency over a large index and the event ingest rate.

Builds, without NATS, the state a router would have after ``--blocks`` stored blocks from
``--workers`` workers: prompts of ``--prompt-tokens`` tokens, each starting with one of 32
shared "system prompts" (a quarter of its length) followed by its own tokens, spread round
robin over the workers. Then:

- ingest: wire-encoded event batches (8 stored events of one prompt each) are decoded and
  applied through ``KvIngest.handle_batch``, the same path as a NATS message callback;
  reported as stored blocks per second (the socket and the NATS client are not included);
- route: ``--routes`` calls of ``Router.route`` (hashing the prompt's token list included)
  with prompts that share a system prompt and a random share of a stored prompt's own
  blocks, each freed after routing so the load state stays steady; p50/p99 in microseconds;
- with ``--prehashed``, each prompt is also routed right after as ``local_hashes`` (what a
  processor sends; the hashing is timed apart, outside the route call): ``route_prehashed_*``
  next to ``route_*``, and ``hash_outside_p50_us``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass

import numpy as np

from services.api.kv_events import KvStored, StoredBlock
from services.api.route import RequestPhase, RouteRequest
from services.api.wire import decode_event_batch_raw, encode_event_batch
from services.bench.results import finish, header, write_json
from services.common.config import ClusterConfig
from services.common.discovery import Registration
from services.common.hashing import block_hashes, local_block_hashes
from services.router.router import Router, tune_gc_for_index

FAMILIES = 32
EVENTS_PER_BATCH = 8


def _build(
    rng: np.random.Generator, n_blocks: int, n_workers: int, prompt_tokens: int, bs: int
) -> tuple[list[bytes], list[np.ndarray], int, int]:
    """Encoded batches, the prompts' tokens, blocks in the events, distinct (worker, block)s."""
    seq_blocks = prompt_tokens // bs
    if seq_blocks < 4:
        raise ValueError(f"--prompt-tokens must cover at least 4 blocks of {bs} tokens")
    n_seqs = max(n_blocks // seq_blocks, 1)
    prefix_tokens = (seq_blocks // 4) * bs
    families = [rng.integers(0, 49152, prefix_tokens, dtype=np.uint32) for _ in range(FAMILIES)]
    seqs: list[np.ndarray] = []
    per_worker: dict[str, list[KvStored]] = {}
    distinct: dict[str, set[int]] = {}
    for i in range(n_seqs):
        tokens = np.concatenate(
            [families[i % FAMILIES], rng.integers(0, 49152, seq_blocks * bs - prefix_tokens, dtype=np.uint32)]
        )
        seqs.append(tokens)
        w = f"w{i % n_workers}"
        evs = per_worker.setdefault(w, [])
        blocks = tuple(StoredBlock(b.seq_hash, b.local_hash) for b in block_hashes(tokens, bs))
        evs.append(KvStored(w, len(evs) + 1, None, blocks))
        distinct.setdefault(w, set()).update(b.seq_hash for b in blocks)
    batches = []
    for w, evs in per_worker.items():
        for j in range(0, len(evs), EVENTS_PER_BATCH):
            batches.append(encode_event_batch(w, 1, evs[j : j + EVENTS_PER_BATCH]))
    return batches, seqs, n_seqs * seq_blocks, sum(len(d) for d in distinct.values())


@dataclass
class RouteTimes:
    """Per route: wall time and this thread's CPU time (CPU time leaves out the time the OS
    ran other processes, which on a shared machine dominates the wall-clock tail)."""

    wall: np.ndarray
    cpu: np.ndarray

    @classmethod
    def empty(cls, n: int) -> RouteTimes:
        return cls(np.empty(n), np.empty(n))

    def summary(self, prefix: str) -> dict[str, float]:
        return {
            f"{prefix}_p50_us": _us(np.percentile(self.wall, 50)),
            f"{prefix}_p99_us": _us(np.percentile(self.wall, 99)),
            f"{prefix}_cpu_p50_us": _us(np.percentile(self.cpu, 50)),
            f"{prefix}_cpu_p99_us": _us(np.percentile(self.cpu, 99)),
        }


def _us(seconds: float) -> float:
    return round(float(seconds) * 1e6, 1)


async def _timed_route(router: Router, req: RouteRequest, times: RouteTimes, i: int) -> float:
    c0, t0 = time.thread_time(), time.perf_counter()
    r = await router.route(req)
    times.wall[i], times.cpu[i] = time.perf_counter() - t0, time.thread_time() - c0
    await router.update(req.request_id, RequestPhase.FINISHED)
    return r.prefix_hit_rate


async def _routes(
    router: Router, prompts: list[list[int]], prehashed: bool
) -> tuple[RouteTimes, RouteTimes | None, np.ndarray | None, float]:
    """Route every prompt as token ids; with ``prehashed`` also, right after, as local
    hashes computed outside the timed call (as a processor sends them), so both series see
    the same machine moments. Returns both series, the hashing times and the mean hit rate."""
    n, bs = len(prompts), router.cfg.engine.block_size
    ids_t = RouteTimes.empty(n)
    hashed_t = RouteTimes.empty(n) if prehashed else None
    hash_s = np.empty(n) if prehashed else None
    hit = 0.0
    for i, p in enumerate(prompts):
        hit += await _timed_route(router, RouteRequest(f"b{i}", p), ids_t, i)
        if hashed_t is not None and hash_s is not None:
            t0 = time.perf_counter()
            hashes = local_block_hashes(p, bs)
            hash_s[i] = time.perf_counter() - t0
            await _timed_route(router, RouteRequest(f"h{i}", (), hashes), hashed_t, i)
    return ids_t, hashed_t, hash_s, hit / n


def main(args: argparse.Namespace) -> int:
    head = header(args)
    tune_gc_for_index()  # as `tandem router` does
    cfg = ClusterConfig()
    bs = cfg.engine.block_size
    rng = np.random.default_rng(0)
    print(f"building {args.blocks} blocks over {args.workers} workers ...", flush=True)
    batches, seqs, stored, distinct = _build(rng, args.blocks, args.workers, args.prompt_tokens, bs)

    router = Router(cfg, seed=0)
    for w in range(args.workers):
        router.ingest.mark_synced(f"w{w}", session=1)
        router.worker_joined(Registration("decode", f"w{w}"))
    t0 = time.perf_counter()
    for data in batches:
        router.ingest.handle_batch(decode_event_batch_raw(data))
    ingest_s = time.perf_counter() - t0
    if router.index.num_blocks() != distinct:
        raise RuntimeError(f"index holds {router.index.num_blocks()} blocks, expected {distinct}")

    prompts = []
    seq_blocks = args.prompt_tokens // bs
    for _ in range(args.routes):
        s = seqs[int(rng.integers(len(seqs)))]
        keep = int(rng.integers(seq_blocks // 4, seq_blocks + 1)) * bs  # the system prompt at least
        fresh = rng.integers(0, 49152, args.prompt_tokens - keep, dtype=np.uint32)
        prompts.append(np.concatenate([s[:keep], fresh]).tolist())
    ids_t, hashed_t, hash_s, hit = asyncio.run(_routes(router, prompts, args.prehashed))

    result: dict[str, object] = {
        **ids_t.summary("route"),
        "ingest_blocks_s": round(stored / ingest_s),
    }
    if hashed_t is not None and hash_s is not None:
        result.update(hashed_t.summary("route_prehashed"))
        result["hash_outside_p50_us"] = _us(np.percentile(hash_s, 50))
    result.update({
        "blocks": stored,  # in the events; a block stored twice by one worker is indexed once
        "indexed_blocks": distinct,
        "workers": args.workers,
        "prompt_tokens": args.prompt_tokens,
        "routes": args.routes,
        "mean_prefix_hit_rate": round(hit, 3),
    })
    result = finish(head, result)
    print(json.dumps(result, indent=2))
    write_json(args.json_path, result)
    return 0
