"""Remote prefills and TTFT of the disagg real-long run's requests, simulated with step noise."""
import sys
from services.sim.calibrate import Overheads, run_sim, sim_config
from services.sim.calibrate_workloads import build

P = "engine.step_model=benchmarks/results/sim/profile_epyc_smollm2_2026-11-28c.yaml"
cal = build("real-long", None, False, None, None, None, 24, 0, ("prefill.replicas=2", P))
for host in (0.0, 2.0):
    for sd in (0.0, 0.03, 0.05, 0.07, 0.1, 0.15):
        for seed in (0, 1):
            cfg = sim_config(cal, "configs/disagg.yaml", Overheads(0.0154, 0.0, [], []), host, 0.0)
            cfg = cfg.model_copy(update={"sim": cfg.sim.model_copy(update={"step_noise": sd, "seed": seed})})
            res = run_sim(cal, cfg)
            n = len(res.records)
            tt = sorted(r.ttft_s for r in res.records)
            print(f"host {host} noise {sd} seed {seed}: remote {sum(r.remote for r in res.records)}/{n} ttft mean {sum(tt)/n*1e3:.0f} p90 {tt[int(0.9*n)]*1e3:.0f} ms")
