"""Are the ~50 ms mixed steps after graphed decodes cuDNN attention (plan builds per new
shape)? The same mixed steps with the cuDNN SDPA backend on and off."""
import sys

import torch

from services.common.config import load_config
from services.engine.factory import build_engine
from services.sim.profiler import Profiler

model, dev = sys.argv[1], sys.argv[2]
for cudnn in (True, False):
    torch.backends.cuda.enable_cudnn_sdp(cudnn)
    cfg = load_config(None, [f"model.path={model}", f"engine.device={dev}", "engine.quantization=int4",
                             "engine.block_size=64", "engine.num_kv_blocks=1024", "engine.max_num_seqs=64",
                             "engine.max_num_batched_tokens=8192"])
    p = Profiler(build_engine(cfg).engine)
    p.prefill(16, 0)
    p.prefill(128, 0)
    for seqs, ctx in ((4, 256), (4, 256), (16, 256), (1, 40), (16, 1024)):
        steps, mixed = p.decode(seqs, ctx, 4, (16, 128, 512, 16, 128, 512))
        print(f"cudnn={cudnn} decode {seqs}x{ctx} ms", [round(s.seconds * 1e3, 1) for s in steps],
              "mixed 16/128/512 x2 ms", [round(s.seconds * 1e3, 1) for s in mixed], flush=True)
    pre = [round(p.prefill(n, 0).seconds * 1e3, 1) for n in (16, 17, 18, 100, 16, 17, 18, 100)]
    print(f"cudnn={cudnn} fresh prefills 16,17,18,100 x2 ms", pre, flush=True)
