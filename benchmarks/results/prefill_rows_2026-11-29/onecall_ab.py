"""Eager prefill vs the one-call rows path (engine.cpu_prefill), one engine, the two alternating
each round (the runner's switch toggled), median tok/s of `tandem bench engine`'s prefill timing.
usage (repo root): python benchmarks/results/prefill_rows_2026-11-29/onecall_ab.py ROUNDS [KEY=VALUE config overrides...]"""
import sys

import torch

sys.path.insert(0, ".")
from services.common.config import load_config
from services.engine.factory import build_engine
from services.bench.engine import bench_prefill
cfg = load_config(None, ["engine.threads=2", "engine.max_num_batched_tokens=4096", "engine.max_model_len=4096"] + sys.argv[2:])
torch.set_num_threads(2)
engine = build_engine(cfg).engine
gen = torch.Generator().manual_seed(0)
rounds = int(sys.argv[1])
for n in (32, 64, 128, 256, 512, 850, 2048):
    res = {"eager": [], "rows": []}
    for _ in range(rounds):
        for mode in ("eager", "rows"):
            engine.runner.prefill_rows = mode == "rows"
            res[mode].append(bench_prefill(engine, n, 2, gen))
    med = lambda v: sorted(v)[len(v) // 2]
    print(f"{n:5d} tokens: eager {med(res['eager']):7.1f} tok/s, rows {med(res['rows']):7.1f}; rows/eager {med(res['rows'])/med(res['eager']):.3f}", flush=True)
