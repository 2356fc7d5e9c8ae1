"""Decode steps back to back vs with idle gaps between them."""
import sys, time, statistics, json
import torch
from services.common.config import load_config
from services.engine.factory import build_engine
from services.sim.profiler import Profiler
cfg = load_config("configs/agg.yaml", [])
torch.set_num_threads(1)
parts = build_engine(cfg)
p = Profiler(parts.engine)
eng = parts.engine
p.prefill(256, 0)
for b in (1, 4, 16):
    # start b sequences, then time steps with different gaps
    first = p._ids + 1
    for _ in range(b):
        p._add(p._prompt(200), 1500)
    ids = {f"profile-{i}" for i in range(first, first + b)}
    started = set()
    while started != ids:
        started.update(o.request_id for o in eng.step() if o.token_ids)
    row = {}
    for gap in (0, 0.005, 0.02, 0.1):
        ts = []
        for _ in range(25):
            if gap: time.sleep(gap)
            ts.append(p._timed_step().seconds)
        row[gap] = round(statistics.median(ts) * 1e3, 2)
    for rid in ids: eng.abort(rid)
    print("b", b, row, flush=True)
