"""`tandem bench engine`: prefill and decode tokens/s of the real engine (scheduler, paged
KV cache and model together), against the machine's fp32 matmul throughput.

Prefill: one prompt of ``--prompt-len`` random tokens, timed from admission to its first
token (one engine step when the prompt fits the token budget). Decode: N sequences with
distinct ``--decode-context``-token prompts are prefilled, then ``--decode-steps`` batched
decode steps are timed; tokens/s = N * steps / time. Each figure is the median of a few
repetitions. ``--set engine.dtype=bfloat16``, ``engine.quantization=int4|int8|none``
(``engine.quantized_max_rows=null``: the quantized kernels at every batch size) or
``engine.device=cuda`` measure those
(this replaced benchmarks/engine_forward.py, which timed the runner alone on random
weights: the scheduler and sampler cost little next to a step's matmuls).

``--overlap on,off`` and ``--runners torch,mock`` measure each combination side by side.
``--decode-sampling`` picks the decode requests' sampling: ``greedy`` (default),
``penalties`` (presence, frequency and repetition penalties: the device-side token counts
of logits_process.py) or ``logprobs`` (5 top logprobs per token): compare their tok/s
with greedy's for what those features cost.
``--structured none,json`` adds decode with every sequence under a JSON schema (structured
output: one grammar matcher per sequence, the batch's token mask filled each step: on the
scheduler thread, or with the overlapped loop on a thread of its own) and reports beside it
the mask fill time per step and the time the sampler waited for the mask per step.
Each decode figure comes with the **bubble**: the fraction of the timed wall time the
runner was not computing (``runner.busy_seconds``: inside ``execute``, on the forward
thread, the mock's simulated device time, or CUDA event time), and the scheduler's time
per step (``schedule`` + ``update`` on the step thread). The timed window starts and
ends with no batch in flight (``fence.drain``), so busy time and wall time cover the
same batches.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from services.api.sampling import SamplingParams
from services.api.structured import StructuredOutput
from services.bench.results import finish, header, write_json
from services.common.config import ClusterConfig, load_config
from services.engine.engine import LLMEngine
from services.engine.factory import build_engine
from services.engine.request import GenerateRequest


def bench_schema(steps: int) -> StructuredOutput:
    """An array of records that cannot close within ``steps`` tokens (each item takes
    several), so every sequence stays constrained, and alive, for the whole timed window."""
    item = {"type": "object", "required": ["id", "name", "ok"], "additionalProperties": False,
            "properties": {"id": {"type": "integer", "minimum": 0},
                           "name": {"type": "string", "maxLength": 12},
                           "ok": {"type": "boolean"}}}
    return StructuredOutput.json_schema({"type": "array", "items": item, "minItems": steps})


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


DECODE_SAMPLING: dict[str, dict] = {
    "greedy": {},
    "penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1},
    "logprobs": {"logprobs": 5},
}


def bench_decode(engine: LLMEngine, n: int, steps: int, context: int, repeats: int,
                 gen: torch.Generator, structured: StructuredOutput | None = None,
                 sampling_mode: str = "greedy") -> dict[str, float]:
    """Median decode tokens/s of ``n`` sequences, with the bubble and scheduler ms/step
    (and, under ``structured``, the mask fill ms/step)."""
    vocab = engine.runner.vocab_size
    runner, fence = engine.runner, engine.kv.fence
    rates, bubbles, sched_ms, fill_ms, wait_ms, seqs = [], [], [], [], [], []
    grammar = engine.grammar.stats if engine.grammar is not None else None
    sampling = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True,
                              structured=structured, **DECODE_SAMPLING[sampling_mode])
    warm = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for r in range(repeats):
        prompts = [_random_prompt(gen, context, vocab) for _ in range(n)]
        # NOTE: every prompt is prefilled once first, alone, so its blocks wait in the prefix
        # cache and the timed requests all start within a step or two. Otherwise the first
        # prompts decode while the last ones prefill (under the ITL target, one slice a
        # step: hundreds of steps for 32 long prompts) and finish before the window, which
        # then times a few sequences instead of n.
        for i, prompt in enumerate(prompts):
            engine.add_request(GenerateRequest(f"decode-{n}-{r}-{i}-warm", prompt, warm))
        _drain(engine)
        for i, prompt in enumerate(prompts):
            engine.add_request(GenerateRequest(f"decode-{n}-{r}-{i}", prompt, sampling))
        # Prefill everything before timing: every sequence has produced its first token.
        started: set[str] = set()
        while len(started) < n:
            started.update(o.request_id for o in engine.step() if o.token_ids)
        fence.drain()  # nothing computing when the clock starts
        busy0, sched0, steps0 = runner.busy_seconds, engine.scheduler_seconds, engine.num_steps
        fill0 = grammar.mask_fill_seconds.total if grammar is not None else 0.0
        wait0 = grammar.mask_wait_seconds.total if grammar is not None else 0.0
        per_step = []
        t0 = time.perf_counter()
        for _ in range(steps):
            per_step.append(sum(len(o.token_ids) for o in engine.step()))
        fence.drain()  # ... nor when it stops: the busy time is all inside the window
        wall = time.perf_counter() - t0
        rates.append(sum(per_step) / wall)
        # (an overlapped step may hand back nothing: its tokens come with the next one)
        seqs.append(statistics.median([k for k in per_step if k] or [0]))
        bubbles.append(max(0.0, 1 - (runner.busy_seconds - busy0) / wall))
        sched_ms.append((engine.scheduler_seconds - sched0) / (engine.num_steps - steps0) * 1e3)
        if grammar is not None:
            steps_done = engine.num_steps - steps0
            fill_ms.append((grammar.mask_fill_seconds.total - fill0) / steps_done * 1e3)
            wait_ms.append((grammar.mask_wait_seconds.total - wait0) / steps_done * 1e3)
        _drain(engine)
    out = {"tok_s": round(statistics.median(rates), 1),
           # tokens a timed step made (median): n where every sequence decoded through the window
           "seqs_per_step": statistics.median(seqs),
           "bubble": round(statistics.median(bubbles), 4),
           "sched_ms_per_step": round(statistics.median(sched_ms), 3)}
    if structured is not None:
        out["mask_fill_ms_per_step"] = round(statistics.median(fill_ms), 3)
        out["mask_wait_ms_per_step"] = round(statistics.median(wait_ms), 3)
    return out


_OVERLAP_SETTING = {"on": "true", "off": "false", "auto": "auto"}


def _modes(arg: str, default: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    modes = [m.strip() for m in (arg or default).split(",") if m.strip()]
    bad = [m for m in modes if m not in allowed]
    if bad or not modes:
        raise SystemExit(f"{flag}: expected a comma-separated subset of {','.join(allowed)}, "
                         f"got {arg!r}")
    return modes


def _bench_one(cfg: ClusterConfig, args: argparse.Namespace, concurrency: list[int],
               structured: list[str]) -> dict:
    engine = build_engine(cfg).engine
    gen = torch.Generator().manual_seed(0)
    out: dict = {"prefill_tok_s": round(bench_prefill(engine, args.prompt_len, 3, gen), 1)}
    if "none" in structured:
        out["decode"] = {
            str(n): bench_decode(engine, n, args.decode_steps, args.decode_context, 2, gen,
                                 sampling_mode=args.decode_sampling)
            for n in concurrency
        }
    if "json" in structured:
        if engine.grammar is None:
            raise SystemExit(f"--structured json: the {cfg.engine.runner} runner (or a model "
                             "without a tokenizer) has no structured output")
        schema = bench_schema(args.decode_steps)
        out["decode_json"] = {
            str(n): bench_decode(engine, n, args.decode_steps, args.decode_context, 2, gen, schema,
                                 args.decode_sampling)
            for n in concurrency
        }
    engine.check_integrity()
    graphs = getattr(engine.runner, "graphs", None)  # CUDA: decode steps that replayed one
    if graphs is not None:
        out["cuda_graphs"] = {"captured": graphs.num_graphs, "replays": graphs.replays,
                              "steps": engine.num_steps}
    out["device"] = str(getattr(engine.runner, "device", "cpu"))
    out["dtype"] = str(getattr(engine.runner, "dtype", cfg.engine.dtype))
    # what engine.quantization resolved to ("auto" -> none | int4); the mock has none
    out["quantization"] = getattr(engine.runner, "quantization", "none")
    print(f"  ran on {out['device']}, {out['dtype'].removeprefix('torch.')}, "
          f"quantization {out['quantization']}", flush=True)
    return out


def main(args: argparse.Namespace) -> int:
    head = header(args)
    overrides = [f"engine.threads={args.threads}", *args.overrides]
    cfg = load_config(args.config, overrides)
    torch.set_num_threads(args.threads)
    concurrency = [int(c) for c in args.concurrency.split(",") if c]
    # NOTE: by default the engine's own choice: `auto` stays auto (off for torch on a CPU).
    default_overlap = {True: "on", False: "off"}.get(cfg.engine.overlap, "auto")  # type: ignore[call-overload]
    overlaps = _modes(args.overlap, default_overlap, ("on", "off", "auto"), "--overlap")
    runners = _modes(args.runners, cfg.engine.runner, ("torch", "mock"), "--runners")
    structured = _modes(args.structured, "none", ("none", "json"), "--structured")
    need_seqs = max(concurrency, default=1)
    # every decode sequence must stay resident, or preemption would be timed too
    need_blocks = need_seqs * -(-(args.decode_context + args.decode_steps + 4) // cfg.engine.block_size)
    raise_to = []
    if cfg.engine.max_num_seqs < need_seqs:
        raise_to.append(f"engine.max_num_seqs={need_seqs}")
    if cfg.engine.num_kv_blocks < need_blocks:
        raise_to.append(f"engine.num_kv_blocks={need_blocks}")
    results: dict = {"matmul_gflops": round(matmul_gflops(), 1), "runs": {}}
    for runner in runners:
        for mode in overlaps:
            run_cfg = load_config(args.config, [*overrides, *raise_to, f"engine.runner={runner}",
                                                f"engine.overlap={_OVERLAP_SETTING[mode]}"])
            print(f"{runner} runner, overlap {mode}: {run_cfg.model.path} on "
                  f"{run_cfg.engine.device} with {args.threads} threads ...", flush=True)
            results["runs"][f"{runner}/overlap-{mode}"] = _bench_one(run_cfg, args, concurrency,
                                                                     structured)
    results["config"] = {
        "threads": args.threads,
        "prompt_len": args.prompt_len,
        "decode_steps": args.decode_steps,
        "decode_context": args.decode_context,
        "decode_sampling": args.decode_sampling,
        "model": cfg.model.path,
    }
    _print_table(results, concurrency, runners, overlaps, structured)
    write_json(args.json_path, finish(head, results))
    return 0


_DECODE_KEY = {"none": "decode", "json": "decode_json"}


def _print_table(results: dict, concurrency: list[int], runners: list[str],
                 overlaps: list[str], structured: list[str]) -> None:
    """on/off: this row's tok/s over the same row with overlap off; json/none: a json
    row's tok/s over the unconstrained row of the same runner and overlap."""
    print(f"fp32 matmul GFLOP/s: {results['matmul_gflops']}")
    print(f"{'runner':<8}{'overlap':<9}{'output':<8}{'seqs':>6}{'decode tok/s':>14}{'seqs/step':>11}{'bubble':>9}"
          f"{'sched ms/step':>15}{'fill ms/step':>14}{'wait ms/step':>14}{'on/off':>8}"
          f"{'json/none':>11}")
    runs = results["runs"]
    for runner in runners:
        for mode in overlaps:
            run = runs[f"{runner}/overlap-{mode}"]
            if "cuda_graphs" in run:
                g = run["cuda_graphs"]
                print(f"{runner}, overlap {mode}: {g['captured']} decode CUDA graphs, "
                      f"replayed in {g['replays']} of {g['steps']} steps")
            print(f"{runner:<8}{mode:<9}{'':<8}{'prefill':>6}{run['prefill_tok_s']:>14}")
            for kind in structured:
                key = _DECODE_KEY[kind]
                for n in concurrency:
                    d = run[key][str(n)]
                    ratio = vs_none = ""
                    if mode == "on" and f"{runner}/overlap-off" in runs:
                        off = runs[f"{runner}/overlap-off"][key][str(n)]["tok_s"]
                        ratio = f"{d['tok_s'] / off:.3f}" if off else ""
                    if kind == "json" and "decode" in run:
                        free = run["decode"][str(n)]["tok_s"]
                        vs_none = f"{d['tok_s'] / free:.3f}" if free else ""
                    fill = d.get("mask_fill_ms_per_step", "")
                    wait = d.get("mask_wait_ms_per_step", "")
                    print(f"{runner:<8}{mode:<9}{kind:<8}{n:>6}{d['tok_s']:>14}{d['seqs_per_step']:>11}"
                          f"{d['bubble'] * 100:>8.1f}%{d['sched_ms_per_step']:>15}{fill:>14}"
                          f"{wait:>14}{ratio:>8}{vs_none:>11}")
