"""The int4 matmul of this checkout against another checkout's, in one process, alternating:
on a machine whose speed moves between minutes, a ratio of calls made side by side is the
figure that holds. From the repo root:

    python benchmarks/results/avx2_epyc_2026-11-29/inproc_ab.py OTHER_CHECKOUT [ROUNDS]

Builds OTHER_CHECKOUT's decode.cpp for this CPU's best set under the op namespace
tandem_other, loads this checkout's own build through the engine, checks that both give
the same bits, then times int4_linear on SmolLM2's layer-3 weights with 1 thread
(thread CPU time, best of 3 a round) for each shape, the two alternating each round.
THREADS=2 in the environment: both on 2 threads, timed by the wall clock."""
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, ".")
from services.common.config import EngineConfig  # noqa: E402
from services.engine.cpu_kernels import build  # noqa: E402
from services.engine.cpu_kernels import isa as isas  # noqa: E402
from services.engine.runner.torch_runner import TorchRunner  # noqa: E402
from services.engine.weights import load_weights  # noqa: E402
from services.model.store import default_model_path  # noqa: E402

other, rounds = Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 20
threads = int(os.environ.get("THREADS", "1"))
clock = time.thread_time if threads == 1 else time.perf_counter
flags = build.cpuinfo_flags()
isa = isas.best(flags)
out = Path("/tmp/tandem_other.so")
cmd = ["g++", *[f for f in build._flags(isa, isas.cflags(isa, flags)) if not f.startswith("-DTANDEM_OPS")],
       "-DTANDEM_OPS=tandem_other", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
       *(f"-I{p}" for p in build.include_paths()), str(other / "services/engine/cpu_kernels/decode.cpp"),
       f"-L{Path(torch.__file__).parent / 'lib'}", "-lc10", "-ltorch_cpu", "-o", str(out)]
subprocess.run(cmd, check=True)
torch.ops.load_library(str(out))
w = load_weights(default_model_path())
r = TorchRunner(w.arch, w.tensors, EngineConfig(threads=threads, num_kv_blocks=64, max_model_len=1024), quant_source=w.quant)
torch.set_num_threads(threads)
layer = r.model.layers[3]
this, that = getattr(torch.ops, build.KernelSet(isa).namespace).int4_linear, torch.ops.tandem_other.int4_linear
print(f"kernel set {isa}, {threads} thread(s); this checkout vs {other}")
for name, kin, rows in (("gate_up_proj", 576, 850), ("down_proj", 1536, 850), ("qkv_proj", 576, 850),
                        ("gate_up_proj", 576, 32), ("gate_up_proj", 576, 1)):
    mm = getattr(layer, name).matmul
    x = torch.randn(rows, kin).to(torch.bfloat16)
    args = (x, mm.codes, mm.scale_min, mm.out_features)
    assert torch.equal(this(*args), that(*args)), "the two builds give different bits"
    inner = max(1, 64 // rows) * (1 if rows > 1 else 50)
    times: dict[str, list[float]] = {"this": [], "other": []}
    for _ in range(rounds):
        for key, fn in (("this", this), ("other", that)):
            best = 1e9
            for _ in range(3):
                t = clock()
                for _ in range(inner):
                    fn(*args)
                best = min(best, (clock() - t) / inner)
            times[key].append(best)
    ratio = sorted(o / t for o, t in zip(times["other"], times["this"], strict=True))
    med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
    macs = rows * kin * mm.out_features
    print(f"{name} {rows} x {kin} -> {mm.out_features}: this {macs / med(times['this']) / 1e9:.1f}, "
          f"other {macs / med(times['other']) / 1e9:.1f} GMAC/s (medians); other/this time: median "
          f"{med(ratio):.3f}, p10 {ratio[len(ratio) // 10]:.3f}, p90 {ratio[len(ratio) * 9 // 10]:.3f}")
