"""``tandem bench budget``: the prefill budget study. Long and short prompts arrive beside
running streams on one in-process engine, over a sweep of ``engine.max_num_batched_tokens``
and ``engine.itl_target_ms``; per point: TTFT (short and long prompts), ITL p50/p95/p99,
output tokens/s and add-request latency, against the same engine's decode-only step.

Per point, on a fresh engine (the config with the point's two keys set):

1. ``--streams`` requests of ``--short-tokens`` prompts start and decode; once they all do,
   ``--ref-steps`` decode-only steps are timed: their median is the **decode-only step**.
2. ``--requests`` arrive at ``--rate`` per second (fixed gaps), a ``--long-share`` of them
   with ``--long-tokens`` prompts and the rest with ``--short-tokens``, each generating
   ``--output-tokens``. The engine is stepped as a worker's step thread steps it: an arrival
   is added between steps, so a long step delays it, as it delays a served request.
3. When every arrival finished, ``--ref-steps`` decode-only steps are timed again (the
   **decode-only step at the end**: the streams alone at their final contexts, which grew
   through phase 2; on the CPU a decode step's attention grows with its context), then the
   streams are aborted. Phase 2's decode-only step lies between the two references, so
   ITL p99 over each brackets its ratio to a decode-only step of the same contexts.

**Add-request latency**: from a request's arrival to the step that first schedules it (the
queue and the step in progress). **ITL**: the gaps between consecutive tokens of every
request in phase 2, the streams' included (the streams' gaps are what a long prompt's prefill
stretches). **Throughput**: output tokens of phase 2 over its wall time. Prompts are random
token ids (no prefix hits). Model load and phase 1 are not timed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from services.api.sampling import SamplingParams
from services.bench.results import finish, header, write_json
from services.common.config import ClusterConfig, load_config
from services.engine.engine import LLMEngine
from services.engine.factory import build_engine
from services.engine.request import GenerateRequest
from services.engine.sequence import Sequence


@dataclass
class _Timed:
    """One request's arrival, admission and token times (perf_counter seconds)."""

    arrival: float
    long: bool
    seq: Sequence | None = None
    tokens: list[float] = field(default_factory=list)


def _pct(xs: list[float], q: float) -> float | None:
    return round(float(np.percentile(xs, q)) * 1e3, 1) if xs else None


def _prompt(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return [int(x) for x in rng.integers(100, vocab - 100, size=n)]


def _step_into(eng: LLMEngine, timed: dict[str, _Timed]) -> None:
    outs = eng.step()
    now = time.perf_counter()
    for o in outs:
        t = timed.get(o.request_id)
        if t is not None and o.token_ids:
            t.tokens.append(now)


def _decode_steps(eng: LLMEngine, n: int) -> list[float]:
    """Seconds of ``n`` steps of the streams alone (call with nothing else live)."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    return times


def run_point(cfg: ClusterConfig, args: argparse.Namespace) -> dict:
    """One sweep point on a fresh engine built from ``cfg`` (see the module docstring)."""
    eng = build_engine(cfg).engine
    rng = np.random.default_rng(args.seed)
    vocab = eng.runner.vocab_size
    forever = SamplingParams(temperature=0, max_tokens=10**6, ignore_eos=True)
    timed: dict[str, _Timed] = {}
    for i in range(args.streams):
        eng.add_request(GenerateRequest(f"stream{i}", _prompt(rng, args.short_tokens, vocab), forever))
    while eng.scheduler.waiting or any(s.num_generated < 2 for s in eng.scheduler.running):
        eng.step()
    ref = _decode_steps(eng, args.ref_steps)
    # phase 2: the streams' tokens count from here
    t0 = time.perf_counter()
    for i in range(args.streams):
        timed[f"stream{i}"] = _Timed(t0, False)
    sp = SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)
    arrivals = []
    for i in range(args.requests):
        long = bool(rng.random() < args.long_share)
        n = args.long_tokens if long else args.short_tokens
        arrivals.append((t0 + i / args.rate, long, GenerateRequest(f"r{i}", _prompt(rng, n, vocab), sp)))
    pending = list(reversed(arrivals))
    while pending or any(r.request_id in eng.scheduler.seqs for _, _, r in arrivals):
        now = time.perf_counter()
        while pending and pending[-1][0] <= now:
            at, long, req = pending.pop()
            eng.add_request(req)
            timed[req.request_id] = _Timed(at, long, eng.scheduler.seqs[req.request_id])
        if not eng.has_unfinished():  # no streams, nothing live: wait for the next arrival
            time.sleep(max(0.0, pending[-1][0] - time.perf_counter()))
            continue
        _step_into(eng, timed)
    wall = time.perf_counter() - t0
    ref_end = _decode_steps(eng, args.ref_steps)  # the streams alone, at their final contexts
    for i in range(args.streams):
        eng.abort(f"stream{i}")
    while eng.has_unfinished():
        eng.step()

    itl = [b - a for t in timed.values() for a, b in zip(t.tokens, t.tokens[1:], strict=False)]
    reqs = [t for rid, t in timed.items() if not rid.startswith("stream")]
    ttft = {kind: [t.tokens[0] - t.arrival for t in reqs if t.long is kind and t.tokens]
            for kind in (False, True)}
    added = [t.seq.scheduled_at - t.arrival for t in reqs if t.seq is not None]
    decode_ms = statistics.median(ref) * 1e3
    decode_end_ms = statistics.median(ref_end) * 1e3
    itl_p99 = _pct(itl, 99)
    return {
        "max_num_batched_tokens": cfg.engine.max_num_batched_tokens,
        "itl_target_ms": cfg.engine.itl_target_ms or 0.0,
        "decode_only_step_ms": round(decode_ms, 1),
        "decode_only_step_end_ms": round(decode_end_ms, 1),
        "itl_ms": {"p50": _pct(itl, 50), "p95": _pct(itl, 95), "p99": itl_p99,
                   "max": _pct(itl, 100)},
        "itl_p99_over_decode_step": round(itl_p99 / decode_ms, 2) if itl_p99 else None,
        "itl_p99_over_decode_step_end": round(itl_p99 / decode_end_ms, 2) if itl_p99 else None,
        "ttft_short_ms": {"p50": _pct(ttft[False], 50), "p99": _pct(ttft[False], 99)},
        "ttft_long_ms": {"p50": _pct(ttft[True], 50), "p99": _pct(ttft[True], 99)},
        "add_request_ms": {"p50": _pct(added, 50), "p99": _pct(added, 99)},
        "output_tokens_per_s": round(sum(len(t.tokens) for t in timed.values()) / wall, 1),
        "wall_s": round(wall, 2),
        "long_requests": sum(t.long for t in reqs),
        "requests": len(reqs),
        "itl_samples": len(itl),
    }


def _points(text: str, cast: type) -> list:
    return [cast(x) for x in text.split(",") if x.strip()]


def main(args: argparse.Namespace) -> int:
    head = header(args)
    base = load_config(args.config, args.overrides)
    points = []
    for budget in _points(args.budgets, int):
        for target in _points(args.itl_targets, float):
            cfg = base.model_copy(update={"engine": base.engine.model_copy(update={
                "max_num_batched_tokens": budget, "itl_target_ms": target})})
            res = run_point(cfg, args)
            print(json.dumps(res), flush=True)
            points.append(res)
    out = finish(head, {"engine": base.engine.model_dump(mode="json", exclude={"mock"}),
                        "workload": {k: getattr(args, k) for k in (
                            "streams", "requests", "rate", "long_share", "long_tokens",
                            "short_tokens", "output_tokens", "ref_steps", "seed")},
                        "points": points})
    write_json(args.json_path, out)
    if args.plot:
        from services.bench.plots import budget_plot

        print(budget_plot(points, Path(args.plot)))
    return 0
