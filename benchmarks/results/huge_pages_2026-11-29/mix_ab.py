"""decode_forward of this checkout against OTHER_CHECKOUT's (benchmarks/other_kernels.py) on mixed steps,
one process, alternating; MIX: D@CTX+N@P = D decode rows at context CTX beside N prefill rows
after P tokens. THREADS=1 times thread CPU time. usage: python mix_ab.py OTHER [ROUNDS]"""
import os, sys, time
from pathlib import Path
import torch
sys.path.insert(0, ".")
from benchmarks.other_kernels import load_other
exec(open("benchmarks/results/itl_target/avx2_2026-11-29/mixstep.py").read().split("def shape")[0])
that = load_other(Path(sys.argv[1])).decode_forward
this = fn
src = open("benchmarks/results/itl_target/avx2_2026-11-29/mixstep.py").read()
exec("def shape" + src.split("def shape")[1].split("def t(")[0].replace("return lambda: fn(", "return lambda fn: fn("))
clk = time.thread_time if threads == 1 else time.perf_counter
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
for spec in os.environ.get("MIX", "8@650+16@1000,8@1024+0@0,0@0+16@1000").split(","):
    d, p = spec.split("+"); nd, ctx = map(int, d.split("@")); npre, pre = map(int, p.split("@"))
    f = shape(nd, ctx, npre, pre)
    a, b = f(this), f(that)
    same = torch.equal(a, b)
    ts = {"this": [], "other": []}
    for _ in range(rounds):
        for k, g in (("this", this), ("other", that)):
            best = 1e9
            for _ in range(5):
                t0 = clk(); f(g); best = min(best, clk() - t0)
            ts[k].append(best)
    med = lambda v: sorted(v)[len(v)//2]
    ratio = sorted(o / t for o, t in zip(ts["other"], ts["this"]))
    print(f"{spec}: same {same}; this {med(ts['this'])*1e3:.1f} ms, other {med(ts['other'])*1e3:.1f} ms; other/this {med(ratio):.3f} ({ratio[0]:.3f}-{ratio[-1]:.3f})")
