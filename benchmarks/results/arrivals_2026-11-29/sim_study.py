"""bench compare's disagg-vs-agg workload (mixed 32/768 tokens, 40% long, 32 out, 60
requests, Poisson, SLO TTFT 3 s / TPOT 100 ms) in the simulator over seeds: agg against
disagg (1 decode + 1 prefill worker), with the short (32-token) and long prompts' TTFT apart.

    python sim_study.py PROFILE SEEDS RATES   # e.g. ../sim/profile_epyc_avx2_smollm2_2026-11-29.yaml 20 0.5,1,2
    OV="decode.disagg.arrival_weight=0" python sim_study.py ...   # overrides for disagg

(../disagg_2026-11-28/sim_study.py is the same study for the ITL weight.)"""
import json, os, statistics, sys
from services.bench import workloads
from services.bench.arrivals import ArrivalSpec
from services.sim.calibrate import Overheads, run_sim, sim_config
from services.sim.calibrate_workloads import Calibration
from services.sim.report import summary

PROF = sys.argv[1]
SEEDS = range(int(sys.argv[2]) if len(sys.argv) > 2 else 10)
RATES = [float(x) for x in (sys.argv[3] if len(sys.argv) > 3 else "1,2").split(",")]
P = f"engine.step_model={PROF}"
LAYOUTS = {
    "agg": ("configs/agg.yaml", ()),
    "disagg": ("configs/disagg.yaml", ("decode.replicas=1", "prefill.replicas=1", *os.environ.get("OV", "").split())),
}
def q(xs, p):
    xs = sorted(xs); return xs[min(len(xs) - 1, int(p * len(xs)))]
out = {}
for rate in RATES:
    for name, (cfgf, ov) in LAYOUTS.items():
        p99s, atts, means, sh50, sh90, lo50, itl99, remotes = [], [], [], [], [], [], [], []
        for seed in SEEDS:
            reqs = workloads.mixed_lengths(60, 32, 768, 0.4, 32, seed)
            cal = Calibration("mixed", cfgf, (*ov, P), reqs, ArrivalSpec("poisson", rate=rate, seed=seed))
            cfg = sim_config(cal, cfgf, Overheads(0.015, 0.0 if "disagg" in name else None, [], []), 2.0, 0.0, 0.09)
            cfg = cfg.model_copy(update={"sim": cfg.sim.model_copy(update={"seed": seed})})
            res = run_sim(cal, cfg)
            rs = [r for r in res.records if r.completed]
            ttft = [r.ttft_s for r in rs]
            short = [r.ttft_s for r in rs if r.prompt_tokens < 100]
            long_ = [r.ttft_s for r in rs if r.prompt_tokens >= 100]
            ok = sum(1 for r in rs if r.ttft_s <= 3.0 and (r.tokens_out <= 1 or (r.end_s - r.first_token_s) / (r.tokens_out - 1) <= 0.1))
            p99s.append(q(ttft, 0.99)); means.append(statistics.fmean(ttft)); atts.append(ok / 60)
            sh50.append(q(short, .5)); sh90.append(q(short, .9)); lo50.append(q(long_, .5))
            itl99.append(summary(res)['itl_ms']['p99']); remotes.append(sum(r.remote for r in res.records))
        out[(rate, name)] = p99s
        med = statistics.median
        print(f"rate {rate} {name:7s} ttft p99 {med(p99s):.2f} mean {statistics.fmean(means):.2f} short p50/p90 {med(sh50):.3f}/{med(sh90):.3f} long p50 {med(lo50):.2f} attain {med(atts):.3f} (>=.9 {sum(a>=.9 for a in atts)}/{len(atts)}) itl99 {med(itl99):.0f} remote {statistics.fmean(remotes):.1f}", flush=True)
    r = [x / y for x, y in zip(out[(rate, "agg")], out[(rate, "disagg")])]
    print(f"   agg/disagg TTFT p99: median {statistics.median(r):.2f}, >=1 in {sum(x >= 1 for x in r)}/{len(r)}")
