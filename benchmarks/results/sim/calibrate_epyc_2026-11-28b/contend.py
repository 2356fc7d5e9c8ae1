"""Time decode and prefill steps of one engine; run 1 or 2 copies at once."""
import sys, time, statistics, json
import torch
from services.common.config import load_config
from services.engine.factory import build_engine
from services.sim.profiler import Profiler
cfg = load_config("configs/agg.yaml", [])
torch.set_num_threads(1)
parts = build_engine(cfg)
p = Profiler(parts.engine)
p.prefill(256, 0)
res = {}
for rep in range(int(sys.argv[1])):
    for b, ctx in ((1, 128), (8, 256), (32, 256)):
        steps, _ = p.decode(b, ctx, 40)
        res.setdefault(f"decode b{b}", []).append(statistics.median(s.seconds for s in steps) * 1e3)
    for n in (64, 512):
        res.setdefault(f"prefill {n}", []).append(statistics.median(p.prefill(n, 0).seconds for _ in range(3)) * 1e3)
print(json.dumps({k: round(statistics.median(v), 2) for k, v in res.items()}))
