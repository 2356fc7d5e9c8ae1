"""`tandem bench serve`: run one workload against an OpenAI-compatible endpoint, print a
summary, write JSON results and optionally TTFT/ITL CDF plots."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from services.bench import workloads
from services.bench.arrivals import ArrivalSpec
from services.bench.client import RunResult, run_workload
from services.bench.metrics import Summary, parse_slos, request_latencies, summarize
from services.bench.results import header, load_average, write_json


def build_workload(args: argparse.Namespace) -> list[workloads.BenchRequest]:
    n = args.num_requests
    if args.workload == "shared-prefix":
        per = max(1, -(-n // args.groups))
        return workloads.shared_prefix(args.groups, per, args.system_len, args.question_len,
                                       args.output_len, args.seed)[:n]
    if args.workload == "multi-turn":
        convs = max(1, -(-n // args.turns))
        return workloads.multi_turn(convs, args.turns, args.system_len, args.user_len,
                                    args.assistant_len, args.output_len, args.seed)[:n]
    if args.workload == "mixed":
        return workloads.mixed_lengths(n, args.short_len, args.long_len, args.long_fraction,
                                       args.output_len, args.seed)
    if not args.trace:
        raise ValueError(f"--workload {args.workload} needs --trace FILE")
    if args.workload == "mooncake":
        return workloads.mooncake(args.trace, args.scale or 1 / 32, args.output_scale, n, args.seed)
    return workloads.azure(args.trace, args.scale or 1 / 8, args.output_scale, n, args.seed)


def arrival_spec(args: argparse.Namespace) -> ArrivalSpec:
    return ArrivalSpec(args.arrival, rate=args.rate, burstiness=args.burstiness,
                       concurrency=args.concurrency, speedup=args.speedup, seed=args.seed)


def result_json(run: RunResult, summary: Summary, oracle: float, meta: dict) -> dict:
    reqs = []
    itls: list[float] = []
    for r in run.records:
        row: dict = {"index": r.index, "ok": r.ok, "error": r.error, "prompt_len": r.prompt_len,
                     "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens,
                     "cached_tokens": r.cached_tokens}
        if r.ok:
            ttft, tpot, gaps, e2e = request_latencies(r)
            row.update(ttft_ms=ttft, tpot_ms=tpot, e2e_ms=e2e, max_itl_ms=max(gaps, default=None))
            itls.extend(gaps)
        reqs.append(row)
    return {"meta": meta, "summary": summary.to_dict(), "oracle_prefix_hit_rate": oracle,
            "requests": reqs, "itl_ms": itls}


def slim(res: dict) -> dict:
    """A result without its per-request rows and ITL samples: what benchmarks/results/ keeps."""
    return {k: res[k] for k in ("meta", "summary", "oracle_prefix_hit_rate")}


def _load_1m() -> float | None:
    la = load_average()
    return la[0] if la else None


def run_and_measure(args: argparse.Namespace, base_url: str, model: str,
                    reqs: list[workloads.BenchRequest]) -> dict:
    """Run ``reqs`` (``build_workload(args)``) as ``args`` say, return the result JSON (see
    ``result_json``)."""
    slos = parse_slos(args.slo)
    oracle = workloads.oracle_hit_rate([r.prompt_ids for r in reqs], args.block_size)
    load_before = _load_1m()
    run = asyncio.run(run_workload(base_url, model, reqs, arrival_spec(args), args.num_requests,
                                   args.duration, args.endpoint, args.timeout,
                                   os.environ.get("OPENAI_API_KEY")))
    summary = summarize(run.records, run.duration_s, slos)
    meta = {"base_url": base_url, "model": model, "workload": args.workload,
            "arrival": args.arrival, "num_requests": len(run.records),
            "args": {k: v for k, v in vars(args).items() if not k.startswith("_")},
            "load_average_1m": {"before": load_before, "after": _load_1m()}}
    return result_json(run, summary, oracle, meta)


def format_summary(res: dict) -> str:
    s = res["summary"]
    lines = [f"completed {s['completed']}  failed {s['failed']}  in {s['duration_s']:.1f}s  "
             f"({s['request_throughput']:.2f} req/s, {s['output_throughput']:.1f} out tok/s)"]
    for k in ("ttft", "tpot", "itl", "e2e"):
        d = s[k]
        lines.append(f"{k.upper():5s} ms  mean {d['mean']:8.1f}  p50 {d['p50']:8.1f}  "
                     f"p90 {d['p90']:8.1f}  p99 {d['p99']:8.1f}")
    hit = s["prefix_hit_rate"]
    lines.append(f"prefix hit rate {'n/a' if hit is None else f'{hit:.3f}'}  "
                 f"(infinite-cache oracle {res['oracle_prefix_hit_rate']:.3f})")
    if s["goodput"] is not None:
        lines.append(f"goodput {s['goodput']:.2f} req/s under {s['slos']}")
    if s["errors"]:
        lines.append(f"errors {s['errors']}")
    la = res["meta"]["load_average_1m"]
    lines.append(f"load average (1m) before {la['before']}, after {la['after']}")
    return "\n".join(lines)


def _sweep(args: argparse.Namespace, head: dict) -> int:
    # NOTE: imported here: rate_sweep builds on this module's run_and_measure
    from services.bench.rate_sweep import report, run_rates
    from services.bench.sweep import check_sweep, parse_rates

    try:
        rates = parse_rates(args.rates)
        check_sweep(parse_slos(args.slo), args.attainment, args.arrival)
        results = run_rates(args, args.base_url, args.model, rates)
    except ValueError as e:
        print(f"tandem bench serve: {e}", file=sys.stderr)
        return 2
    report(head, {args.model: results}, rates, args)
    return 0 if all(r["summary"]["completed"] for r in results) else 1


def main(args: argparse.Namespace) -> int:
    head = header(args)
    if args.rates is not None:
        return _sweep(args, head)
    try:
        res = run_and_measure(args, args.base_url, args.model, build_workload(args))
    except ValueError as e:
        print(f"tandem bench serve: {e}", file=sys.stderr)
        return 2
    print(format_summary(res))
    write_json(args.json_path, {**head, **res})
    if args.plot_dir:
        from services.bench.plots import latency_cdfs

        ttft = [r["ttft_ms"] for r in res["requests"] if r["ok"]]
        for p in latency_cdfs({args.model: ttft}, {args.model: res["itl_ms"]}, args.plot_dir):
            print(f"wrote {p}")
    return 0 if res["summary"]["completed"] else 1
