"""`tandem bench engine`: prefill and decode tokens/s of the real engine (scheduler, paged
KV cache and model together), against the machine's fp32 matmul throughput.

Prefill: one prompt of ``--prompt-len`` random tokens, timed from admission to its first
token (one engine step when the prompt fits the token budget). Decode: N sequences with
distinct ``--decode-context``-token prompts are prefilled, then ``--decode-steps`` batched
decode steps are timed; tokens/s = N * steps / time. Each figure is the median of a few
repetitions. ``--set engine.dtype=bfloat16`` or ``engine.device=cuda`` measure those
(this replaced benchmarks/engine_forward.py, which timed the runner alone on random
weights: the scheduler and sampler cost little next to a step's matmuls).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from services.bench.results import finish, header, write_json
from services.common.config import load_config
from services.engine.engine import LLMEngine
from services.engine.factory import build_engine
from services.engine.request import GenerateRequest, SamplingParams


def matmul_gflops(n: int = 1024, repeats: int = 20) -> float:
    """Best-of fp32 GEMM throughput on the current torch thread count."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    out = torch.empty(n, n)
    torch.mm(a, b, out=out)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b, out=out)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def _random_prompt(gen: torch.Generator, n: int, vocab: int) -> list[int]:
    # NOTE: skip the low ids, which hold the special tokens in Llama-family vocabularies.
    return torch.randint(100, vocab, (n,), generator=gen).tolist()


def _drain(engine: LLMEngine) -> None:
    while engine.has_unfinished():
        engine.step()


def bench_prefill(engine: LLMEngine, prompt_len: int, repeats: int, gen: torch.Generator) -> float:
    vocab = engine.runner.vocab_size
    rates = []
    greedy_one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for i in range(repeats + 1):  # the first run warms up allocators and caches
        request = GenerateRequest(f"prefill-{i}", _random_prompt(gen, prompt_len, vocab), greedy_one)
        engine.validate(request)  # --prompt-len may not fit this engine
        engine.add_request(request)
        t0 = time.perf_counter()
        _drain(engine)
        if i:
            rates.append(prompt_len / (time.perf_counter() - t0))
    return statistics.median(rates)


def bench_decode(engine: LLMEngine, n: int, steps: int, context: int, repeats: int,
                 gen: torch.Generator) -> float:
    vocab = engine.runner.vocab_size
    rates = []
    sampling = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    for r in range(repeats):
        for i in range(n):
            engine.add_request(
                GenerateRequest(f"decode-{n}-{r}-{i}", _random_prompt(gen, context, vocab), sampling)
            )
        # Prefill everything before timing: every sequence has produced its first token.
        started: set[str] = set()
        while len(started) < n:
            started.update(o.request_id for o in engine.step() if o.token_ids)
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        rates.append(n * steps / (time.perf_counter() - t0))
        _drain(engine)
    return statistics.median(rates)


def main(args: argparse.Namespace) -> int:
    head = header(args)
    overrides = [f"engine.threads={args.threads}", *args.overrides]
    cfg = load_config(args.config, overrides)
    torch.set_num_threads(args.threads)
    concurrency = [int(c) for c in args.concurrency.split(",") if c]
    need_seqs = max(concurrency, default=1)
    # every decode sequence must stay resident, or preemption would be timed too
    need_blocks = need_seqs * -(-(args.decode_context + args.decode_steps + 2) // cfg.engine.block_size)
    raise_to = []
    if cfg.engine.max_num_seqs < need_seqs:
        raise_to.append(f"engine.max_num_seqs={need_seqs}")
    if cfg.engine.num_kv_blocks < need_blocks:
        raise_to.append(f"engine.num_kv_blocks={need_blocks}")
    if raise_to:
        cfg = load_config(args.config, [*overrides, *raise_to])
    print(f"loading {cfg.model.path} on {cfg.engine.device} with {args.threads} threads ...", flush=True)
    engine = build_engine(cfg).engine
    gen = torch.Generator().manual_seed(0)
    results: dict = {"matmul_gflops": round(matmul_gflops(), 1)}
    results["prefill_tok_s"] = round(bench_prefill(engine, args.prompt_len, 3, gen), 1)
    results["decode_tok_s"] = {
        str(n): round(bench_decode(engine, n, args.decode_steps, args.decode_context, 2, gen), 1)
        for n in concurrency
    }
    engine.check_integrity()
    results["config"] = {
        "threads": args.threads,
        "prompt_len": args.prompt_len,
        "decode_steps": args.decode_steps,
        "decode_context": args.decode_context,
        "device": str(engine.runner.device) if hasattr(engine.runner, "device") else "cpu",
        "dtype": str(getattr(engine.runner, "dtype", cfg.engine.dtype)),
        "model": cfg.model.path,
    }
    print(f"{'metric':<28}{'value':>12}")
    print(f"{'fp32 matmul GFLOP/s':<28}{results['matmul_gflops']:>12}")
    print(f"{'prefill tok/s (' + str(args.prompt_len) + ' tok)':<28}{results['prefill_tok_s']:>12}")
    for n, v in results["decode_tok_s"].items():
        print(f"{'decode tok/s @ ' + n + ' seqs':<28}{v:>12}")
    write_json(args.json_path, finish(head, results))
    return 0
