"""`tandem sim decisions`: choose the cluster's decisions on your traces.

For each trace and each cluster size: find the load at which round robin saturates (the
highest ``--speedup`` at which it completes requests as fast as they arrive), then replay
the trace at ``--loads`` fractions of that speedup under every routing policy of
``ROUTING`` (aggregated: every worker decodes) and every remote-prefill policy of
``PREFILL`` (a quarter of the workers prefill, the rest decode). Prints one table per
(trace, workers, load) and writes every summary to ``--json``.

Saturation: the run keeps up when its throughput (completed / virtual duration) is at least
``KEEPS_UP`` of the offered rate (requests / the trace's span at that speedup); a backlog
stretches the duration and drops the ratio. Found by doubling, then bisecting in log space.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from services.bench.results import finish, header, write_json
from services.common.config import load_config
from services.sim import report, traces
from services.sim.requests import SimRequest
from services.sim.simulator import simulate
from services.steptime.profile import step_model_for

KEEPS_UP = 0.95
BISECT_STEPS = 3
# name -> overrides: today's blend at two weights, the ttft policy at three affinity bands
ROUTING: dict[str, tuple[str, ...]] = {
    "round_robin": ("router.mode=round_robin",),
    "kv w=1": ("router.mode=kv", "router.overlap_weight=1"),
    "kv w=4": ("router.mode=kv", "router.overlap_weight=4"),
    "ttft band=0": ("router.mode=ttft", "router.affinity_band=0"),
    "ttft band=0.1": ("router.mode=ttft", "router.affinity_band=0.1"),
    "ttft band=0.3": ("router.mode=ttft", "router.affinity_band=0.3"),
}
PREFILL: dict[str, tuple[str, ...]] = {
    "threshold 256": ("decode.disagg.policy=threshold", "decode.disagg.max_local_prefill_length=256"),
    "threshold 2048": ("decode.disagg.policy=threshold",
                       "decode.disagg.max_local_prefill_length=2048"),
    "predict 256": ("decode.disagg.policy=predict", "decode.disagg.max_local_prefill_length=256"),
    "predict 0": ("decode.disagg.policy=predict", "decode.disagg.max_local_prefill_length=0"),
}


@dataclass(frozen=True)
class Trace:
    name: str
    requests: list[SimRequest]
    span_s: float  # first to last arrival at speedup 1


def _load(path: str, limit: int | None) -> Trace:
    reqs = traces.select(traces.load_trace(path), limit=limit)
    span = reqs[-1].arrival_s - reqs[0].arrival_s if reqs else 0.0
    return Trace(Path(path).name, reqs, span)


def _run(base: Sequence[str], config: str | None, trace: Trace, speedup: float,
         overrides: Sequence[str], oracle: float) -> dict:
    cfg = load_config(config, [*base, *overrides])
    reqs = traces.select(trace.requests, speedup=speedup)
    maker = traces.PromptMaker(cfg.sim.seed)
    result = simulate(cfg, reqs, step_model_for(cfg), maker.make, oracle)
    return report.summary(result)


def keeps_up(summary: dict, trace: Trace, speedup: float) -> float:
    """Throughput over the offered rate (1.0: it kept up)."""
    offered = len(trace.requests) / (trace.span_s / speedup) if trace.span_s > 0 else math.inf
    return summary["throughput_rps"] / offered if offered else 1.0


def saturation(base: Sequence[str], config: str | None, trace: Trace, oracle: float,
               start: float = 1.0) -> tuple[float, list[dict]]:
    """The highest speedup at which round robin keeps up, and the probes that found it."""
    probes: list[dict] = []
    rr = ROUTING["round_robin"]

    def ok(s: float) -> bool:
        summary = _run(base, config, trace, s, rr, oracle)
        ratio = keeps_up(summary, trace, s)
        probes.append({"speedup": round(s, 4), "keeps_up": round(ratio, 4),
                       "ttft_mean_ms": summary["ttft_ms"]["mean"]})
        print(f"  saturation probe: speedup {s:.3g} -> throughput/offered {ratio:.3f}",
              file=sys.stderr, flush=True)
        return ratio >= KEEPS_UP

    lo, hi = start, start
    if ok(start):
        while ok(hi * 2):
            hi *= 2
        lo, hi = hi, hi * 2
    else:
        while not ok(lo / 2):
            lo /= 2
            if lo < 1e-3:
                raise ValueError(f"{trace.name}: round robin does not keep up even at speedup {lo}")
        lo, hi = lo / 2, lo
    for _ in range(BISECT_STEPS):
        mid = math.sqrt(lo * hi)
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo, probes


def _row(name: str, s: dict) -> dict[str, object]:
    err = s.get("ttft_prediction_error", {})
    oracle = s["oracle_hit_rate"]
    return {
        "policy": name,
        "ttft_mean_ms": s["ttft_ms"]["mean"], "ttft_p99_ms": s["ttft_ms"]["p99"],
        "itl_p99_ms": s["itl_ms"]["p99"],
        "hit/oracle": round(s["prefix_hit_rate"] / oracle, 3) if oracle else 0.0,
        "goodput_rps": s["goodput_rps"], "remote": s["remote_prefill_fraction"],
        "pred_err_p50": err.get("rel_p50", ""), "pred_err_p90": err.get("rel_p90", ""),
    }


def main(args: argparse.Namespace) -> int:
    head = header(args)
    workers = [int(w) for w in args.workers.split(",")]
    loads = [float(x) for x in args.loads.split(",")]
    out: list[dict] = []
    try:
        for path in args.traces:
            trace = _load(path, args.num_requests)
            for n in workers:
                base = [*args.overrides, f"decode.replicas={n}", "prefill.replicas=0",
                        "decode.disagg.enabled=false"]
                cfg = load_config(args.config, base)
                oracle = traces.oracle_hit_rate(trace.requests, cfg.engine.block_size,
                                                traces.PromptMaker(cfg.sim.seed))
                t0 = time.perf_counter()
                sat, probes = saturation(base, args.config, trace, oracle)
                print(f"{trace.name}, {n} workers: round robin saturates at speedup {sat:.3g}"
                      f" ({time.perf_counter() - t0:.0f} s)", flush=True)
                prefill_n = max(1, n // 4)
                disagg = [*args.overrides, f"decode.replicas={n - prefill_n}", "decode.disagg.enabled=true",
                          f"prefill.replicas={prefill_n}"]
                for load in loads:
                    speedup = sat * load
                    rows = []
                    for kind, grid, base_o in (("routing", ROUTING, base),
                                               ("prefill", PREFILL, disagg)):
                        if kind == "prefill" and not args.prefill:
                            continue
                        for name, ov in grid.items():
                            extra = (*ov, f"router.mode={args.prefill_router}") \
                                if kind == "prefill" else ov
                            s = _run(base_o, args.config, trace, speedup, extra, oracle)
                            rows.append({"kind": kind, **_row(name, s)})
                            out.append({"trace": trace.name, "workers": n, "load": load,
                                        "speedup": round(speedup, 4), "kind": kind,
                                        "policy": name, "summary": s})
                    print(f"\n{trace.name}, {n} workers, {load:.0%} of round robin's saturation"
                          f" (speedup {speedup:.3g})")
                    print(report.format_table(rows), flush=True)
                out.append({"trace": trace.name, "workers": n, "saturation_speedup": round(sat, 4),
                            "probes": probes})
    except (ValueError, OSError) as e:
        print(f"tandem sim decisions: {e}", file=sys.stderr)
        return 2
    write_json(args.json_path, finish(head, {"runs": out}))
    return 0
