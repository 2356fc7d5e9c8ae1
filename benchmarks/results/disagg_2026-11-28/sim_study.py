"""bench compare's disagg-vs-agg workload (mixed 32/768 tokens, 40% long, 32 out, 60
requests, Poisson at 1 and 2 req/s, SLO TTFT 3 s / TPOT 100 ms) in the simulator, over many
seeds, for disagg decision variants."""
import json, statistics, sys
from services.bench import workloads
from services.bench.arrivals import ArrivalSpec
from services.sim.calibrate import Overheads, run_sim, sim_config
from services.sim.calibrate_workloads import Calibration
from services.sim.report import summary

PROF = sys.argv[1] if len(sys.argv) > 1 else "/tmp/cal/prof_now.yaml"
SEEDS = range(int(sys.argv[2]) if len(sys.argv) > 2 else 10)
P = f"engine.step_model={PROF}"
LAYOUTS = {
    "agg": ("configs/agg.yaml", ()),
    "disagg itl_weight=1": ("configs/disagg.yaml", ("decode.replicas=1", "prefill.replicas=1", "decode.disagg.itl_weight=1")),
    "disagg itl_weight=0": ("configs/disagg.yaml", ("decode.replicas=1", "prefill.replicas=1", "decode.disagg.itl_weight=0")),
    "disagg itl_weight=0.25": ("configs/disagg.yaml", ("decode.replicas=1", "prefill.replicas=1", "decode.disagg.itl_weight=0.25")),
    "disagg itl_weight=0.5": ("configs/disagg.yaml", ("decode.replicas=1", "prefill.replicas=1", "decode.disagg.itl_weight=0.5")),
}

def q(xs, p):
    xs = sorted(xs); return xs[min(len(xs) - 1, int(p * len(xs)))]

out = {}
for rate in (1.0, 2.0):
    for name, (cfgf, ov) in LAYOUTS.items():
        p99s, atts, means, remotes, itl99 = [], [], [], [], []
        for seed in SEEDS:
            reqs = workloads.mixed_lengths(60, 32, 768, 0.4, 32, seed)
            cal = Calibration("mixed", cfgf, (*ov, P), reqs, ArrivalSpec("poisson", rate=rate, seed=seed))
            cfg = sim_config(cal, cfgf, Overheads(0.015, 0.0 if "disagg" in name else None, [], []), 2.0, 0.0, 0.09)
            cfg = cfg.model_copy(update={"sim": cfg.sim.model_copy(update={"seed": seed})})
            res = run_sim(cal, cfg)
            rs = [r for r in res.records if r.completed]
            ttft = [r.ttft_s for r in rs]
            ok = sum(1 for r in rs if r.ttft_s <= 3.0 and (r.tokens_out <= 1 or (r.end_s - r.first_token_s) / (r.tokens_out - 1) <= 0.1))
            p99s.append(q(ttft, 0.99)); means.append(statistics.fmean(ttft)); atts.append(ok / 60)
            remotes.append(sum(r.remote for r in res.records)); itl99.append(summary(res)['itl_ms']['p99'])
        out[(rate, name)] = (p99s, atts)
        print(f"rate {rate} {name:22s} ttft p99 med {statistics.median(p99s):.2f} s [{min(p99s):.2f}-{max(p99s):.2f}]  mean {statistics.fmean(means):.2f} s  attain med {statistics.median(atts):.3f} (>=0.9 in {sum(a >= 0.9 for a in atts)}/{len(atts)})  remote {statistics.fmean(remotes):.1f}  itl p99 med {statistics.median(itl99):.0f} ms", flush=True)
    a = out[(rate, "agg")][0]
    for name in LAYOUTS:
        if name != "agg":
            r = [x / y for x, y in zip(a, out[(rate, name)][0])]
            print(f"   agg/{name} TTFT p99 ratio (>=1: disagg no worse): median {statistics.median(r):.2f}, >=1.0 in {sum(x >= 1 for x in r)}/{len(r)}")
