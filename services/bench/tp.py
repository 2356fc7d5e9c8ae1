"""`tandem bench tp`: what users of a tensor-parallel engine feel, sync vs async request
broadcast (``engine.tp_broadcast``) at each TP size, side by side in one run and one table.

Mixed requests (tp_mix.py: short and long prompts, a share of them carrying an image on a
LLaVA model, else a large raw payload) arrive as a seeded Poisson process at an engine
driven in-process the way the worker's loop drives it: add every arrival that is due, then
step. Per (TP size, mode) row (tp_streams.py): running streams' ITL p50/p99 over quiet
gaps and over gaps in which a request arrived (the step delay an arrival causes), TTFT
p50/p99, output tokens/s, and how long one arrival held the loop in ``add_request``. TP=1
has no broadcast: one baseline row. A size the model cannot split is listed as skipped
(SmolLM2-135M: 9 heads and 3 KV heads, so no TP=2).

Every rank is a process (rank 0 with ``--threads`` torch threads, the others with
``engine.tp_rank_threads``): where their threads exceed the cores here (TP=3 on 2 cores)
the ranks share cores, and the row is marked.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from services.bench.results import finish, header, write_json
from services.bench.tp_mix import ImageShape, Mix, MixSpec, make_mix
from services.bench.tp_streams import RunRecord, figures
from services.common.config import load_config
from services.engine.engine import LLMEngine
from services.engine.factory import build_engine, is_llava_dir
from services.engine.parallel.shard import check_tp_layout
from services.engine.tp.runner import TpRunner
from services.model.arch import ModelArchConfig
from services.model.store import resolve_model_path


def parse_sizes(arg: str) -> list[int]:
    """``"1,3,2"`` -> [1, 2, 3]; ValueError naming a bad item."""
    sizes: set[int] = set()
    for item in arg.split(","):
        try:
            n = int(item)
        except ValueError:
            raise ValueError(f"--tp {arg!r}: {item!r} is not a size") from None
        if n < 1:
            raise ValueError(f"--tp {arg!r}: sizes must be >= 1, got {n}")
        sizes.add(n)
    return sorted(sizes)


def model_shape(model_path: Path) -> tuple[ModelArchConfig, ImageShape | None]:
    """The language model's architecture, and a LLaVA model's image shape (else None)."""
    if is_llava_dir(model_path):
        from services.engine.multimodal.weights import read_llava_arch

        llava = read_llava_arch(model_path)
        return llava.text, ImageShape(llava.image_token_id, llava.tokens_per_image, llava.text.hidden_size)
    from services.engine.weights import load_weights

    return load_weights(model_path).arch, None


def split_problem(arch: ModelArchConfig, size: int) -> str | None:
    """Why ``arch`` cannot run at TP=``size``, or None when it can."""
    try:
        check_tp_layout(arch, size)
    except ValueError as e:
        return str(e)
    return None


def run_mix(engine: LLMEngine, mix: Mix) -> RunRecord:
    """Drive ``engine`` through ``mix``'s arrivals as AsyncEngine's loop does: every arrival
    that is due, then one step; asleep until the next arrival when nothing runs."""
    runner = engine.runner
    if isinstance(runner, TpRunner):
        runner.extra_payload = lambda r: mix.payload if r.request_id in mix.heavy else b""
    arrival_s = {r.request_id: t for r, t in zip(mix.requests, mix.offsets, strict=True)}
    chunks: dict[str, list[tuple[int, int]]] = {r.request_id: [] for r in mix.requests}
    step_end: list[float] = []
    step_arrivals: list[int] = []
    add_s = 0.0
    nxt, n = 0, len(mix.requests)
    t0 = time.perf_counter()
    while nxt < n or engine.has_unfinished():
        now = time.perf_counter() - t0
        if not engine.has_unfinished() and mix.offsets[nxt] > now:
            time.sleep(mix.offsets[nxt] - now)
            continue
        arrived = 0
        ta = time.perf_counter()
        while nxt < n and mix.offsets[nxt] <= now:
            engine.add_request(mix.requests[nxt])
            nxt += 1
            arrived += 1
        add_s += time.perf_counter() - ta
        outputs = engine.step()
        step_end.append(time.perf_counter() - t0)
        step_arrivals.append(arrived)
        for o in outputs:
            if o.token_ids:
                chunks[o.request_id].append((len(step_end) - 1, len(o.token_ids)))
    engine.check_integrity()
    return RunRecord(step_end, step_arrivals, arrival_s, chunks, add_s)


def warm_up(engine: LLMEngine, spec: MixSpec, image: ImageShape | None) -> None:
    """Two long heavy requests, untimed: the first forwards and the first broadcast of a
    large payload pay one-time costs that would otherwise land on the first arrivals."""
    warm = replace(spec, requests=2, rate=1e6, long_share=1.0, heavy_share=1.0, output_len=2, seed=spec.seed + 1)
    run_mix(engine, make_mix(warm, engine.runner.vocab_size, image, engine.runner.dtype, prefix="warm"))


def main(args: argparse.Namespace) -> int:
    head = header(args)
    base = ["engine.runner=torch", f"engine.threads={args.threads}", "engine.overlap=false", *args.overrides]
    cfg = load_config(args.config, base)
    sizes = parse_sizes(args.tp)
    torch.set_num_threads(args.threads)
    arch, image = model_shape(resolve_model_path(cfg.model.path))
    spec = MixSpec(args.requests, args.rate, args.short_len, args.long_len, args.long_share, args.heavy_share,
                   args.payload_kib, args.output_len, args.seed)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    heavy = "an image" if image is not None else f"{spec.payload_kib} KiB of payload"
    print(f"{spec.requests} requests at {spec.rate}/s: {spec.long_share:.0%} long ({spec.long_len} tokens, else "
          f"{spec.short_len}), {spec.heavy_share:.0%} with {heavy}, {spec.output_len} output tokens", flush=True)
    rows: list[dict] = []
    skipped: dict[str, str] = {}
    for size in sizes:
        why = split_problem(arch, size)
        if why is not None:
            skipped[str(size)] = why
            print(f"TP={size}: skipped ({why})", flush=True)
            continue
        for mode in ("none",) if size == 1 else ("sync", "async"):
            over = [*base, f"engine.tensor_parallel_size={size}"]
            if size > 1:
                over.append(f"engine.tp_broadcast={mode}")
            print(f"TP={size}, broadcast {mode} ...", flush=True)
            engine = build_engine(load_config(args.config, over)).engine
            try:
                warm_up(engine, spec, image)
                record = run_mix(engine, make_mix(spec, engine.runner.vocab_size, image, engine.runner.dtype))
            finally:
                engine.runner.close()
            threads = args.threads + (size - 1) * cfg.engine.tp_rank_threads
            rows.append({"tp": size, "broadcast": mode, "oversubscribed": threads > cores,
                         **asdict(figures(record))})
    results = {"rows": rows, "skipped": skipped, "cores": cores,
               "config": {**asdict(spec), "threads": args.threads, "rank_threads": cfg.engine.tp_rank_threads,
                          "images": image is not None,
                          "model": cfg.model.path, "dtype": cfg.engine.dtype}}
    _print(results)
    write_json(args.json_path, finish(head, results))
    return 0


def _pair(d: dict) -> str:
    return f"{d['p50']:.1f} / {d['p99']:.1f}"


def _print(results: dict) -> None:
    rows = results["rows"]
    print(f"{'TP':>3}  {'broadcast':<10}{'ITL p50/p99 ms, quiet':>24}{'ITL p50/p99 ms, arrival':>26}"
          f"{'TTFT p50/p99 ms':>20}{'out tok/s':>11}{'add ms/arrival':>16}")
    for r in rows:
        print(f"{r['tp']:>3}{'*' if r['oversubscribed'] else ' '} {r['broadcast']:<10}"
              f"{_pair(r['itl_quiet']):>24}{_pair(r['itl_arrival']):>26}{_pair(r['ttft']):>20}"
              f"{r['output_tok_s']:>11.1f}{r['add_ms_per_arrival']:>16.3f}")
    if any(r["oversubscribed"] for r in rows):
        print(f"* oversubscribed: the ranks' threads exceed the {results['cores']} cores here, so the ranks "
              "share cores and the row measures that contention as well as tensor parallelism")
    for size, why in results["skipped"].items():
        print(f"TP={size} skipped: {why}")
    by = {(r["tp"], r["broadcast"]): r for r in rows}
    for size in sorted({r["tp"] for r in rows if r["tp"] > 1}):
        s, a = by[(size, "sync")], by[(size, "async")]
        print(f"TP={size} async vs sync: ITL p99 with an arrival {s['itl_arrival']['p99']:.1f} -> "
              f"{a['itl_arrival']['p99']:.1f} ms (quiet {s['itl_quiet']['p99']:.1f} -> {a['itl_quiet']['p99']:.1f}), "
              f"TTFT p99 {s['ttft']['p99']:.1f} -> {a['ttft']['p99']:.1f} ms, "
              f"out tok/s {s['output_tok_s']:.1f} -> {a['output_tok_s']:.1f}")
