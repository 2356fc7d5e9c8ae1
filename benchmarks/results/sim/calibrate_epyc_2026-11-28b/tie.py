"""Does a planning margin in the decision's stats tip the simulated disagg decisions remote?"""
from dataclasses import replace
import services.sim.simulator as simmod
from services.sim.calibrate import Overheads, run_sim, sim_config
from services.sim.calibrate_workloads import build
from services.steptime.chunk import DeviceSpeed

P = "engine.step_model=benchmarks/results/sim/profile_epyc_smollm2_2026-11-28.yaml"
cal = build("real-long", None, False, None, None, None, 24, 0, ("prefill.replicas=2", P))
cfg = sim_config(cal, "configs/disagg.yaml", Overheads(0.0154, 0.0, [], []), 2.0, 0.0)
base = run_sim(cal, cfg)
print("no margin: remote", sum(r.remote for r in base.records), "ttft mean", sum(r.ttft_s for r in base.records) / 60)
orig = simmod.worker_times
for swing in (0.1, 0.2):
    sp = DeviceSpeed()
    for i in range(200):
        r = 1 + (swing if i % 2 else -swing)
        sp.observe(True, 1.0, r, False); sp.observe(True, 1.0, r, True); sp.observe(False, 1.0, r, False)
    def wt(c, m, stats, kv, *a, _sp=sp):
        return orig(c, m, replace(stats, step_speed=_sp), kv, *a)
    simmod.worker_times = wt
    res = run_sim(cal, cfg)
    print(f"spread ~{swing}: plan x{sp.prefill.plan():.3f}: remote", sum(r.remote for r in res.records), "ttft mean", sum(r.ttft_s for r in res.records) / 60)
simmod.worker_times = orig
