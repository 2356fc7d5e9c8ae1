"""`tandem bench tp`: tensor parallelism's two costs, side by side in one run.

**Burst** (sync vs async request broadcast): ``--requests`` short requests
(``--prompt-len`` tokens, one output token) each carrying ``--payload-kib`` of raw payload
bytes (what an image would be) arrive at once at an engine at ``--tp``. The loop is the
worker's (AsyncEngine's): apply every queued arrival, then step. Reported at the entry
rank: admitted requests/s (arrivals over the time until the last one was added), loop
step time p50/p99 (adds + forward), and the share of the entry's loop time spent blocked
in payload broadcasts; and each other rank's wait for payloads per step.

**Decode**: batched decode tokens/s at TP=1 and at ``--tp`` (``bench engine``'s decode).

``--tp auto`` takes the smallest size above 1 that divides the model (SmolLM2-135M: 3; its 9
heads and 3 KV heads do not split two ways).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from services.api.sampling import SamplingParams
from services.bench.engine import bench_decode
from services.bench.results import finish, header, write_json
from services.common.config import ClusterConfig, load_config
from services.engine.engine import LLMEngine
from services.engine.factory import build_engine
from services.engine.parallel.shard import check_tp_layout
from services.engine.request import GenerateRequest
from services.engine.tp.runner import TpRunner


def pick_tp(cfg: ClusterConfig, arg: str) -> int:
    if arg != "auto":
        return int(arg)
    from services.engine.weights import load_weights
    from services.model.store import resolve_model_path

    arch = load_weights(resolve_model_path(cfg.model.path)).arch
    for n in range(2, arch.num_heads + 1):
        try:
            check_tp_layout(arch, n)
            return n
        except ValueError:
            continue
    raise SystemExit(f"--tp auto: no size above 1 divides {cfg.model.path}")


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def bench_burst(engine: LLMEngine, n: int, prompt_len: int, payload: bytes) -> dict[str, float]:
    runner = engine.runner
    assert isinstance(runner, TpRunner)
    runner.extra_payload = lambda _r: payload
    vocab = runner.vocab_size
    gen = torch.Generator().manual_seed(0)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    pending = [GenerateRequest(f"burst-{i}", torch.randint(100, vocab, (prompt_len,), generator=gen).tolist(), one)
               for i in range(n)]
    blocked0 = runner.broadcaster.blocked_seconds
    waits0 = {s.rank: (s.steps, s.broadcast_wait_seconds) for s in runner.rank_stats()}
    steps: list[float] = []
    admitted_at = 0.0
    t0 = time.perf_counter()
    while pending or engine.has_unfinished():
        ts = time.perf_counter()
        for r in pending:  # every queued arrival, as AsyncEngine applies its commands
            engine.add_request(r)
        if pending:
            admitted_at = time.perf_counter() - t0
            pending = []
        engine.step()
        steps.append(time.perf_counter() - ts)
    wall = time.perf_counter() - t0
    engine.check_integrity()
    runner.close()  # joins the ranks: their stats are final
    others = [s for s in runner.rank_stats() if s.rank > 0]
    rank_wait_ms = [
        (s.broadcast_wait_seconds - waits0[s.rank][1]) / max(1, s.steps - waits0[s.rank][0]) * 1e3
        for s in others]
    return {
        "admitted_req_s": round(n / admitted_at, 1),
        "step_p50_ms": round(statistics.median(steps) * 1e3, 2),
        "step_p99_ms": round(_pct(steps, 0.99) * 1e3, 2),
        "blocked_share": round((runner.broadcaster.blocked_seconds - blocked0) / sum(steps), 4),
        "rank_wait_ms_per_step": round(max(rank_wait_ms, default=0.0), 3),
        "steps": len(steps),
        "wall_s": round(wall, 2),
    }


def main(args: argparse.Namespace) -> int:
    head = header(args)
    base = [f"engine.threads={args.threads}", "engine.overlap=false", *args.overrides]
    cfg = load_config(args.config, base)
    tp = pick_tp(cfg, args.tp)
    torch.set_num_threads(args.threads)
    payload = os.urandom(args.payload_kib * 1024)
    results: dict = {"tp": tp, "burst": {}, "decode": {}}
    for mode in ("sync", "async"):
        run_cfg = load_config(args.config, [*base, f"engine.tensor_parallel_size={tp}",
                                            f"engine.tp_broadcast={mode}"])
        print(f"burst, {mode} broadcast: {args.requests} requests x {args.payload_kib} KiB at TP={tp} ...",
              flush=True)
        engine = build_engine(run_cfg).engine
        results["burst"][mode] = bench_burst(engine, args.requests, args.prompt_len, payload)
    need_blocks = args.decode_seqs * -(-(args.decode_context + args.decode_steps + 4) // cfg.engine.block_size)
    for size in (1, tp):
        run_cfg = load_config(args.config, [*base, f"engine.tensor_parallel_size={size}",
                                            f"engine.max_num_seqs={max(args.decode_seqs, cfg.engine.max_num_seqs)}",
                                            f"engine.num_kv_blocks={max(need_blocks, cfg.engine.num_kv_blocks)}"])
        print(f"decode at TP={size}: {args.decode_seqs} sequences ...", flush=True)
        engine = build_engine(run_cfg).engine
        results["decode"][str(size)] = bench_decode(engine, args.decode_seqs, args.decode_steps,
                                                    args.decode_context, 2, torch.Generator().manual_seed(0))
        engine.runner.close()
    results["config"] = {"threads": args.threads, "requests": args.requests, "prompt_len": args.prompt_len,
                         "payload_kib": args.payload_kib, "decode_seqs": args.decode_seqs,
                         "model": cfg.model.path, "dtype": cfg.engine.dtype}
    _print(results)
    write_json(args.json_path, finish(head, results))
    return 0


def _print(results: dict) -> None:
    tp = results["tp"]
    print(f"{'broadcast':<10}{'admitted req/s':>15}{'step p50 ms':>13}{'step p99 ms':>13}"
          f"{'blocked':>9}{'rank wait ms/step':>19}")
    for mode, r in results["burst"].items():
        print(f"{mode:<10}{r['admitted_req_s']:>15}{r['step_p50_ms']:>13}{r['step_p99_ms']:>13}"
              f"{r['blocked_share'] * 100:>8.2f}%{r['rank_wait_ms_per_step']:>19}")
    sync, asyn = results["burst"]["sync"], results["burst"]["async"]
    if sync["admitted_req_s"]:
        print(f"async/sync admitted req/s: {asyn['admitted_req_s'] / sync['admitted_req_s']:.2f}x")
    d1, dn = results["decode"]["1"], results["decode"][str(tp)]
    print(f"decode tok/s: TP=1 {d1['tok_s']}, TP={tp} {dn['tok_s']} ({dn['tok_s'] / d1['tok_s']:.2f}x)")
