"""The one-call decode step and lm_head with the kernel weights on huge pages (as the engine
places them, engine.cpu_huge_pages) against copies of the same weights on 4 KiB pages
(one mapping advised MADV_NOHUGEPAGE), in one process, alternating: on a machine whose speed moves between
minutes, calls made side by side are what compare.
usage (repo root): python benchmarks/results/huge_pages_2026-11-29/inproc_ab.py [ROUNDS]
env THREADS (2); SHAPES: dN = N decode rows at 256 tokens of context, lm = lm_head on 1 row."""
import mmap
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, ".")
from services.common.config import EngineConfig  # noqa: E402
from services.engine import huge_pages  # noqa: E402
from services.engine.runner.torch_runner import TorchRunner  # noqa: E402
from services.engine.weights import load_weights  # noqa: E402
from services.model.store import default_model_path  # noqa: E402

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 9
threads = int(os.environ.get("THREADS", "2"))
w = load_weights(default_model_path())
r = TorchRunner(w.arch, w.tensors, EngineConfig(threads=threads, num_kv_blocks=1024, max_model_len=2048),
                quant_source=w.quant)
torch.set_num_threads(threads)
cd = r.model.cpu_decode
print(f"huge pages available: {huge_pages.available()}, this process on huge pages: "
      f"{huge_pages.huge_page_bytes() / 1e6:.0f} MB; {threads} thread(s)")


def small_pages(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies in one mapping advised MADV_NOHUGEPAGE: 4 KiB pages whatever the heap gets."""
    size = sum(-(-t.numel() * t.element_size() // 64) * 64 for t in ts) + 4096
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_NOHUGEPAGE)
    buf, off, out = torch.frombuffer(region, dtype=torch.uint8), 0, []
    for t in ts:
        n = t.numel() * t.element_size()
        out.append(buf[off:off + n].view(t.dtype).view(t.shape).copy_(t))
        off += -(-n // 64) * 64
    return out


head = r.model.lm_head.matmul
placed = {"huge": list(cd.weights), "plain": small_pages(list(cd.weights))}
heads = {"huge": (head.codes, head.scale_min), "plain": tuple(small_pages([head.codes, head.scale_min]))}


def use(kind: str) -> None:
    cd.weights[:] = placed[kind]
    head.codes, head.scale_min = heads[kind]


bs = 16
for shape in os.environ.get("SHAPES", "d1,lm,d8,d32").split(","):
    if shape == "lm":
        h = torch.randn(1, w.arch.hidden_size).to(torch.bfloat16)
        def call() -> None:
            r.model.compute_logits(h)
    else:
        n, ctx = int(shape[1:]), 256
        nb = ctx // bs
        pos = torch.full((n,), ctx - 1, dtype=torch.int64)
        table = torch.arange(n * nb, dtype=torch.int64).view(n, nb).contiguous()
        slots = table[:, -1] * bs + bs - 1
        ids = torch.randint(0, 49000, (n,))
        def call() -> torch.Tensor:
            return cd._decode_forward(ids, pos, slots, table, pos + 1, cd.embed, r._kv_layers, cd.weights, cd.cos,
                                      cd.sin, cd.final_norm, cd.dims, cd.eps)
        use("huge"); a = call(); use("plain"); b = call()
        assert torch.equal(a, b)
    times: dict[str, list[float]] = {"huge": [], "plain": []}
    inner = 20 if shape in ("d1", "lm") else 5
    for _ in range(rounds):
        for kind in ("huge", "plain"):
            use(kind)
            call()
            best = 1e9
            for _ in range(inner):
                t0 = time.perf_counter()
                call()
                best = min(best, time.perf_counter() - t0)
            times[kind].append(best)
    ratio = sorted(p / h for p, h in zip(times["plain"], times["huge"], strict=True))
    print(f"{shape}: huge {statistics.median(times['huge']) * 1e3:.2f} ms, plain "
          f"{statistics.median(times['plain']) * 1e3:.2f} ms; plain/huge median {statistics.median(ratio):.3f} "
          f"(range {ratio[0]:.3f}-{ratio[-1]:.3f})")
