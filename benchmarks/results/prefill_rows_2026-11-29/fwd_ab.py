"""The one-call step (decode_forward) of this checkout against OTHER_CHECKOUT's, in one
process: both builds loaded side by side (the other under the op namespace tandem_other),
the same bits checked, then timed alternating, best of a few calls a round.
usage (repo root): python benchmarks/results/prefill_rows_2026-11-29/fwd_ab.py OTHER_CHECKOUT [ROUNDS]
env THREADS (2); SHAPES: N = a prefill of N tokens as rows, dN = N decode rows at 256 context."""
import os, sys, time
from pathlib import Path
import torch
sys.path.insert(0, ".")
from benchmarks.other_kernels import load_other
from services.common.config import EngineConfig
from services.engine.cpu_kernels import build, isa as isas
from services.engine.runner.torch_runner import TorchRunner
from services.engine.weights import load_weights
from services.model.store import default_model_path

other, rounds = Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 5
threads = int(os.environ.get("THREADS", "2"))
that = load_other(other).decode_forward
isa = isas.best(build.cpuinfo_flags())
w = load_weights(default_model_path())
bs = 16
r = TorchRunner(w.arch, w.tensors, EngineConfig(threads=threads, num_kv_blocks=1024, max_model_len=2048), quant_source=w.quant)
torch.set_num_threads(threads)
cd = r.model.cpu_decode
this = getattr(torch.ops, build.KernelSet(isa).namespace).decode_forward
shapes = os.environ.get("SHAPES", "850,64,16,d1,d32").split(",")
for shape in shapes:
    if shape.startswith("d"):  # decode: T sequences at context 256 each, own blocks
        T = int(shape[1:]); ctx = 256; nb = ctx // bs
        pos = torch.full((T,), ctx - 1, dtype=torch.int64)
        table = torch.arange(T * nb, dtype=torch.int64).view(T, nb).contiguous()
        slots = table[:, -1] * bs + bs - 1
    else:
        T = int(shape); nb = (T + bs - 1) // bs
        pos = torch.arange(T, dtype=torch.int64)
        table = torch.arange(nb, dtype=torch.int64).repeat(T, 1).contiguous()
        slots = pos.clone()
    ids = torch.randint(0, 49000, (T,), generator=torch.Generator().manual_seed(T))
    def call(fn):
        return fn(ids, pos, slots, table, pos + 1, cd.embed, r._kv_layers, cd.weights, cd.cos, cd.sin,
                  cd.final_norm, cd.dims, cd.eps)
    a = call(this); b = call(that)
    same = torch.equal(a, b)
    print(f"{shape}: same bits: {same}" + ("" if same else f" max diff {(a.float()-b.float()).abs().max().item()}"))
    ts = {"this": [], "other": []}
    for _ in range(rounds):
        for k, fn in (("this", this), ("other", that)):
            best = 1e9
            for _ in range(2 if T > 64 else 10):
                t = time.perf_counter(); call(fn); best = min(best, time.perf_counter() - t)
            ts[k].append(best)
    med = lambda v: sorted(v)[len(v)//2]
    ratio = sorted(o / t for o, t in zip(ts["other"], ts["this"]))
    print(f"  this {med(ts['this'])*1e3:.1f} ms ({T/med(ts['this']):.0f} tok/s), other {med(ts['other'])*1e3:.1f} ms; other/this median {med(ratio):.3f} range {ratio[0]:.3f}-{ratio[-1]:.3f}")
