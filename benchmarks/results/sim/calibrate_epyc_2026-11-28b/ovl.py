"""Speed (timed / modelled) the engine itself learns, overlapped loop, decode runs."""
import sys, time, statistics, json
import torch
from services.api.sampling import SamplingParams
from services.common.config import load_config
from services.engine.factory import build_engine
from services.engine.request import GenerateRequest
ov = sys.argv[1:] 
cfg = load_config("configs/agg.yaml", ["engine.step_model=/tmp/cont/prof_now.yaml", *ov])
torch.set_num_threads(1)
eng = build_engine(cfg).engine
print("overlap", eng.overlap, "speed", eng.speed is not None, flush=True)
g = torch.Generator().manual_seed(0)
n = 0
out = {}
for b in (1, 4, 16, 32):
    before = {k: (f.model_s, f.timed_s) for k, f in eng.speed.fits()}
    ids = []
    for _ in range(b):
        n += 1
        p = torch.randint(100, 40000, (200,), generator=g).tolist()
        eng.add_request(GenerateRequest(f"r{n}", p, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)))
    t0 = time.perf_counter(); steps = 0
    while eng.has_unfinished():
        eng.step(); steps += 1
    wall = time.perf_counter() - t0
    after = {k: (f.model_s, f.timed_s) for k, f in eng.speed.fits()}
    out[b] = {k: round((after[k][1]-before.get(k,(0,0))[1])/max(1e-9, after[k][0]-before.get(k,(0,0))[0]), 3) for k in after if after[k][0] > before.get(k,(0,0))[0]}
    out[b]["wall_ms_per_step"] = round(wall / steps * 1e3, 1)
print(json.dumps(out), flush=True)
