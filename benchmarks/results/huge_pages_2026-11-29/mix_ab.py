"""decode_forward of this checkout against OTHER_CHECKOUT's (benchmarks/other_kernels.py) on
mixed steps, one process, alternating, the same bits checked. MIX: D@CTX+N@P,... = D decode
rows at context CTX beside N prefill rows after P tokens. THREADS (1) of 1 times thread CPU
time. usage (repo root): python benchmarks/results/huge_pages_2026-11-29/mix_ab.py OTHER [ROUNDS]"""
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, ".")
from benchmarks.other_kernels import load_other  # noqa: E402

spec = importlib.util.spec_from_file_location("mixstep", "benchmarks/results/itl_target/avx2_2026-11-29/mixstep.py")
mixstep = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mixstep)

threads = int(os.environ.get("THREADS", "1"))
steps = mixstep.Steps(threads)
ops = {"this": steps.cd._decode_forward, "other": load_other(Path(sys.argv[1])).decode_forward}
clock = time.thread_time if threads == 1 else time.perf_counter
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
for mix in os.environ.get("MIX", "8@650+16@1000,8@1024+0@0,0@0+16@1000").split(","):
    d, p = mix.split("+")
    (nd, ctx), (npre, pre) = (map(int, d.split("@"))), (map(int, p.split("@")))
    f = steps.shape(nd, ctx, npre, pre)
    same = torch.equal(f(ops["this"]), f(ops["other"]))
    ts: dict[str, list[float]] = {"this": [], "other": []}
    for _ in range(rounds):
        for k, op in ops.items():
            best = 1e9
            for _ in range(5):
                t0 = clock()
                f(op)
                best = min(best, clock() - t0)
            ts[k].append(best)
    ratio = sorted(o / t for o, t in zip(ts["other"], ts["this"], strict=True))
    print(f"{mix}: same {same}; this {statistics.median(ts['this']) * 1e3:.1f} ms, other "
          f"{statistics.median(ts['other']) * 1e3:.1f} ms; other/this {statistics.median(ratio):.3f} "
          f"({ratio[0]:.3f}-{ratio[-1]:.3f})")
