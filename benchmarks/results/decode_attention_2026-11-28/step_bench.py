"""One decode-only step of the real SmolLM2 on the CPU kernels, timed by the runner alone:
step_bench.py THREADS CTX[,CTX] ROWS SECONDS POOL_BLOCKS [shuffle]. Each row decodes one
token at context CTX; its blocks are the first ones of a POOL_BLOCKS pool in order, or with
any last argument drawn at random from it, as a pool long in use hands them out."""
import sys, time, glob, torch
sys.path.insert(0, '.')
from pathlib import Path
from services.engine.weights import load_weights
from services.common.config import EngineConfig
from services.engine.runner.torch_runner import TorchRunner
from tests.support.tiny_model import batch, seq
torch.set_num_threads(int(sys.argv[1]))
ctxs = [int(x) for x in sys.argv[2].split(',')]
rows = int(sys.argv[3]) if len(sys.argv) > 3 else 8
p = Path(glob.glob('/root/.cache/tandem/models/SmolLM2-135M-Instruct.Q4_1.gguf')[0])
w = load_weights(p)
maxctx = max(ctxs) + 16
nb = -(-maxctx // 16)
r = TorchRunner(w.arch, w.tensors, EngineConfig(dtype="bfloat16", cpu_kernels=True, num_kv_blocks=int(sys.argv[5]) if len(sys.argv) > 5 else rows * nb + 8, max_model_len=maxctx + 64), quant_source=w.quant)
import random
random.seed(0)
# scatter the blocks as a pool that has been used would
pool = list(range(int(sys.argv[5]) if len(sys.argv) > 5 else rows * nb))
if len(sys.argv) > 6: random.shuffle(pool)
blocks = [pool[i * nb:(i + 1) * nb] for i in range(rows)]
for c in ctxs:
    b = batch(*[seq(f"s{i}", [5] , c, blocks[i]) for i in range(rows)])
    for _ in range(3): r.execute(b)
    t = time.perf_counter(); n = 0
    while time.perf_counter() - t < float(sys.argv[4]) if len(sys.argv) > 4 else n < 20:
        r.execute(b); n += 1
    dt = (time.perf_counter() - t) / n
    print(f"rows {rows} ctx {c}: {dt*1e3:.2f} ms/step", flush=True)
