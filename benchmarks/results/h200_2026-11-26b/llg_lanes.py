"""llguidance fill of 32 rows (bench schema, random walk) by how the rows' matchers share
compiled templates (deep copies share the template's lexer behind one mutex) and by
executor threads."""
import os, statistics, sys, time
import llguidance as llg
import torch
sys.path.insert(0, os.getcwd())
from services.bench.engine import bench_schema
from services.engine.grammar.compiler import GrammarCompiler

tj = open(".gpu/tokenizer.json").read()
W = (49152 + 31) // 32
spec = bench_schema(256)
R = 32
comp = GrammarCompiler(tj, 49152, [2])
print("cpus", os.cpu_count(), flush=True)

def run(lanes: int, nth: int, steps: int = 150) -> float:
    templates = []
    for _ in range(lanes):
        comp._cache.clear()
        comp.check(spec)
        templates.append(comp._cache[spec.key])
    from services.engine.grammar.state import GrammarState
    states = [GrammarState(templates[i % lanes].deep_copy(), "json") for i in range(R)]
    ex = llg.LLExecutor(nth)
    bits = torch.zeros((R, W), dtype=torch.int32)
    gen = torch.Generator().manual_seed(0)
    fill = []
    for step in range(steps):
        t0 = time.perf_counter()
        ex.unsafe_compute_mask_ptr([(s.matcher, i) for i, s in enumerate(states)], bits.data_ptr(), W * 4, R)
        fill.append(time.perf_counter() - t0)
        for i, s in enumerate(states):
            words = bits[i].tolist()
            allowed = [w * 32 + b for w, x in enumerate(words) if x for b in range(32) if (x >> b) & 1 and w * 32 + b < 49152]
            assert s.advance(allowed[int(torch.randint(len(allowed), (1,), generator=gen))]) is None
    return statistics.median(fill[20:]) * 1e3

for lanes, nth in ((1, 1), (1, 4), (2, 2), (4, 4), (8, 8), (32, 4), (32, 8), (32, 12)):
    print(f"lanes={lanes:2d} threads={nth:2d}: fill median {run(lanes, nth):.3f} ms", flush=True)
