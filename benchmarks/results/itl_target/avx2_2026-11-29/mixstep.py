"""A mixed step priced by hand: 8 decode rows at a context, beside N prefill rows of one prompt
after P computed tokens, through the one-call step (decode_forward), against the 8 decodes
alone. usage (repo root): THREADS=1 python benchmarks/results/itl_target/avx2_2026-11-29/mixstep.py
(``Steps`` is also what ../../huge_pages_2026-11-29/mix_ab.py times.)"""
import os
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, ".")
from services.common.config import EngineConfig  # noqa: E402
from services.engine.runner.torch_runner import TorchRunner  # noqa: E402
from services.engine.weights import load_weights  # noqa: E402
from services.model.store import default_model_path  # noqa: E402


class Steps:
    """SmolLM2 on the CPU kernels, and the inputs of one-call steps of a given shape."""

    def __init__(self, threads: int, block_size: int = 16) -> None:
        w = load_weights(default_model_path())
        self.runner = TorchRunner(w.arch, w.tensors, EngineConfig(threads=threads, num_kv_blocks=2048,
                                                                  max_model_len=4096), quant_source=w.quant)
        torch.set_num_threads(threads)
        self.cd, self.bs = self.runner.model.cpu_decode, block_size

    def shape(self, ndec: int, ctx: int, npre: int, prefix: int) -> Callable[[object], torch.Tensor]:
        """``ndec`` decode rows at context ``ctx`` (their own blocks) and ``npre`` prefill rows
        of one prompt after ``prefix`` tokens: returns op -> that step through ``op``
        (a ``decode_forward``)."""
        bs, tabs, pos, slots, nxt = self.bs, [], [], [], 0
        for _ in range(ndec):
            t = list(range(nxt, nxt + (ctx + bs - 1) // bs))
            nxt += len(t)
            tabs.append(t)
            pos.append(ctx - 1)
            slots.append(t[(ctx - 1) // bs] * bs + (ctx - 1) % bs)
        if npre:
            t = list(range(nxt, nxt + (prefix + npre + bs - 1) // bs))
            for p in range(prefix, prefix + npre):
                tabs.append(t)
                pos.append(p)
                slots.append(t[p // bs] * bs + p % bs)
        width = max(len(t) for t in tabs)
        table = torch.tensor([t + [0] * (width - len(t)) for t in tabs], dtype=torch.int64)
        p, s = torch.tensor(pos, dtype=torch.int64), torch.tensor(slots, dtype=torch.int64)
        ids = torch.randint(0, 49000, (len(pos),))
        cd, kv = self.cd, self.runner._kv_layers
        return lambda op: op(ids, p, s, table, p + 1, cd.embed, kv, cd.weights, cd.cos, cd.sin, cd.final_norm,
                             cd.dims, cd.eps)


def median_ms(f: Callable[[], object], n: int = 15) -> float:
    f()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return sorted(times)[n // 2] * 1e3


if __name__ == "__main__":
    steps = Steps(int(os.environ.get("THREADS", "1")))
    op = steps.cd._decode_forward
    for ctx in (256, 1024):
        base = median_ms(lambda: steps.shape(8, ctx, 0, 0)(op))
        print(f"ctx {ctx}: 8 decodes {base:.1f} ms")
        for npre, prefix in ((16, 0), (16, 512), (16, 1000), (32, 1000), (64, 1000)):
            f = steps.shape(8, ctx, npre, prefix)
            m = median_ms(lambda f=f: f(op))
            print(f"   +{npre} prefill rows after {prefix}: {m:.1f} ms ({m / base:.2f}x)")
