"""llguidance mask fill for 32 rows of the bench's JSON schema, by executor threads, with
the SmolLM2 tokenizer: does the fill scale with threads on this host?"""
import os, statistics, sys, time
import llguidance as llg
import torch
sys.path.insert(0, os.getcwd())
from services.bench.engine import bench_schema
from services.engine.grammar.compiler import GrammarCompiler

tj = open(".gpu/tokenizer.json").read()
comp = GrammarCompiler(tj, 49152, [2])
spec = bench_schema(256)
W = (49152 + 31) // 32
gen = torch.Generator().manual_seed(0)
for R in (32,):
    for nth in (1, 2, 4, 8, 0):
        ex = llg.LLExecutor(nth) if nth else comp.executor
        states = [comp.start(spec) for _ in range(R)]
        bits = torch.zeros((R, W), dtype=torch.int32)
        fill, adv = [], []
        for step in range(150):
            t0 = time.perf_counter()
            ex.unsafe_compute_mask_ptr([(s.matcher, i) for i, s in enumerate(states)], bits.data_ptr(), W * 4, R)
            t1 = time.perf_counter()
            toks = []
            for i in range(R):
                words = bits[i].tolist()
                allowed = [w * 32 + b for w, x in enumerate(words) if x for b in range(32) if (x >> b) & 1 and w * 32 + b < 49152]
                toks.append(allowed[int(torch.randint(len(allowed), (1,), generator=gen))])
            t2 = time.perf_counter()
            for s, t in zip(states, toks):
                assert s.advance(t) is None
            t3 = time.perf_counter()
            fill.append(t1 - t0); adv.append(t3 - t2)
        print(f"R={R} executor threads={nth or 'default'}: fill median {statistics.median(fill)*1e3:.3f} ms "
              f"p90 {sorted(fill)[int(0.9*len(fill))]*1e3:.3f}; advance median {statistics.median(adv)*1e3:.3f} ms", flush=True)
