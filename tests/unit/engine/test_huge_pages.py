"""The CPU kernels' packed weights on transparent huge pages (services/engine/huge_pages.py,
``engine.cpu_huge_pages``): the copies hold the same values, aligned, in one mapping advised
for huge pages, and the runner's kernels read them with the same results."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from services.common.config import EngineConfig
from services.engine import huge_pages
from services.engine.cpu_kernels import build
from services.engine.cpu_kernels import isa as isas
from services.engine.quant.linear import Int4Matmul
from services.engine.runner.torch_runner import TorchRunner
from tests.support.tiny_model import batch, seq, tiny_hf_model

THP = pytest.mark.skipif(not huge_pages.available(), reason="no transparent huge pages on request here")


def _mapping_flags(address: int) -> dict[str, str]:
    """/proc/self/smaps' fields of the mapping holding ``address``."""
    fields: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


def test_copies_hold_the_values_aligned_in_one_mapping() -> None:
    g = torch.Generator().manual_seed(0)
    ts = [torch.randint(0, 255, (3, 1000), dtype=torch.uint8, generator=g),
          torch.randn(77, generator=g).to(torch.float16),
          torch.randn(5, 7, generator=g),
          torch.empty(0, dtype=torch.float32)]
    want = [t.clone() for t in ts]
    out = huge_pages.copy_to_huge_pages(ts)
    del ts
    gc.collect()
    for w, c in zip(want, out, strict=True):
        assert c.dtype == w.dtype and c.shape == w.shape and c.is_contiguous()
        assert torch.equal(c, w)
        assert c.data_ptr() % huge_pages.ALIGN == 0
    assert out[0].data_ptr() % huge_pages.HUGE_PAGE == 0  # the mapping starts on a huge page
    # one mapping, in order, with no copy overlapping the next
    assert out[1].data_ptr() >= out[0].data_ptr() + 3000
    assert out[2].data_ptr() >= out[1].data_ptr() + 154
    out[2].fill_(1.5)  # writable, and only its own bytes
    assert torch.equal(out[1], want[1])


def test_gpu_tensors_are_refused() -> None:
    meta = torch.empty(4, device="meta")
    with pytest.raises(ValueError, match="CPU tensors"):
        huge_pages.copy_to_huge_pages([meta])


@THP
def test_the_mapping_is_advised_for_huge_pages() -> None:
    (t,) = huge_pages.copy_to_huge_pages([torch.ones(3 << 20, dtype=torch.uint8)])
    flags = _mapping_flags(t.data_ptr())
    assert flags.get("THPeligible") == "1", flags


RUNNABLE = [i for i in isas.ISAS if build.available(i)]


def _kernel_runner(**cfg) -> TorchRunner:
    model, arch = tiny_hf_model("llama")
    return TorchRunner(arch, model.state_dict(), EngineConfig(
        device="cpu", dtype="bfloat16", quantization="int4", quantized_max_rows=None, block_size=4,
        num_kv_blocks=64, cpu_kernels=True, cpu_isa=RUNNABLE[0], **cfg))


def _kernel_buffers(r: TorchRunner) -> list[torch.Tensor]:
    return [t for m in r.model.modules() if isinstance(m, Int4Matmul) and m.kernels is not None
            for t in (m.codes, m.scale_min)]


@THP
@pytest.mark.skipif(not RUNNABLE, reason="no CPU kernel set can run here")
def test_the_runner_places_every_kernel_weight_and_computes_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    copy = huge_pages.copy_to_huge_pages
    monkeypatch.setattr(huge_pages, "copy_to_huge_pages", lambda ts: calls.append(len(ts)) or copy(ts))
    torch.manual_seed(0)
    on = _kernel_runner()
    off = _kernel_runner(cpu_huge_pages=False)
    assert len(calls) == 1  # off, nothing is copied
    placed, plain = _kernel_buffers(on), _kernel_buffers(off)
    assert len(placed) == len(plain) > 4  # every layer's matmuls and lm_head
    for t in placed:
        assert _mapping_flags(t.data_ptr()).get("THPeligible") == "1"
    # the one-call step reads the moved tensors, not copies left behind
    moved = {t.data_ptr() for t in placed}
    assert {w.data_ptr() for w in on.model.cpu_decode.weights if w.dtype == torch.uint8} <= moved
    for a, b in zip(placed, plain, strict=True):
        assert torch.equal(a, b)
    prompt = [(5 * j + 3) % 100 for j in range(9)]
    logits = [r.logits_for(batch(seq("s", prompt, 0, list(range(4))))) for r in (on, off)]
    assert torch.equal(logits[0], logits[1])
