"""A mixed step priced by hand: 8 decode rows at a context, beside N prefill rows of one prompt after P
computed tokens, through the one-call step (decode_forward), against the 8 decodes alone.
usage (repo root): THREADS=1 python benchmarks/results/itl_target/avx2_2026-11-29/mixstep.py"""
import os, sys, time
import torch
sys.path.insert(0, ".")
from services.common.config import EngineConfig
from services.engine.cpu_kernels import build, isa as isas
from services.engine.runner.torch_runner import TorchRunner
from services.engine.weights import load_weights
from services.model.store import default_model_path
threads = int(os.environ.get("THREADS", "1"))
isa = isas.best(build.cpuinfo_flags())
w = load_weights(default_model_path())
bs = 16
r = TorchRunner(w.arch, w.tensors, EngineConfig(threads=threads, num_kv_blocks=2048, max_model_len=4096), quant_source=w.quant)
torch.set_num_threads(threads)
cd = r.model.cpu_decode
fn = getattr(torch.ops, build.KernelSet(isa).namespace).decode_forward
def shape(ndec, ctx, npre, prefix):
    rows_pos, rows_tab, rows_slots, rows_len = [], [], [], []
    nb = (ctx + bs - 1) // bs
    nxt = 0
    tabs = []
    for i in range(ndec):
        t = list(range(nxt, nxt + nb)); nxt += nb
        tabs.append(t); rows_pos.append(ctx - 1); rows_slots.append(t[(ctx-1)//bs]*bs + (ctx-1) % bs)
    if npre:
        L = prefix + npre; nbp = (L + bs - 1)//bs
        t = list(range(nxt, nxt + nbp)); nxt += nbp
        for j in range(npre):
            p = prefix + j
            tabs.append(t); rows_pos.append(p); rows_slots.append(t[p//bs]*bs + p % bs)
    W = max(len(t) for t in tabs)
    table = torch.tensor([t + [0]*(W-len(t)) for t in tabs], dtype=torch.int64)
    pos = torch.tensor(rows_pos, dtype=torch.int64)
    slots = torch.tensor(rows_slots, dtype=torch.int64)
    T = len(rows_pos)
    ids = torch.randint(0, 49000, (T,))
    return lambda: fn(ids, pos, slots, table, pos + 1, cd.embed, r._kv_layers, cd.weights, cd.cos, cd.sin, cd.final_norm, cd.dims, cd.eps)
def t(f, n=15):
    f(); v=[]
    for _ in range(n):
        a=time.perf_counter(); f(); v.append(time.perf_counter()-a)
    v.sort(); return v[len(v)//2]*1e3
for ctx in (256, 1024):
    base = t(shape(8, ctx, 0, 0))
    print(f"ctx {ctx}: 8 decodes {base:.1f} ms")
    for npre, prefix in ((16, 0), (16, 512), (16, 1000), (32, 1000), (64, 1000)):
        m = t(shape(8, ctx, npre, prefix))
        print(f"   +{npre} prefill rows after {prefix}: {m:.1f} ms ({m/base:.2f}x)")
