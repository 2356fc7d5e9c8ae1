"""Tensors copied onto transparent huge pages (Linux): the CPU kernels' packed weights.

A decode step with few rows streams every weight byte from memory once (SmolLM2 int4: ~84
MB a token). On 4 KiB pages that is ~20,000 pages a step, each a TLB miss and a page walk
as the stream enters it; on 2 MiB pages, ~40. Measured on an AVX2-only AMD EPYC (Zen 4
VM): the one-call decode of one sequence 1.04x faster than on the same weights on 4 KiB
pages, in one process (docs/benchmarks.md "Weights on huge pages"); end to end within that
machine's spread. The KV cache, read in blocks, measured no different.

Most kernels here leave huge pages to ``madvise`` (``/sys/kernel/mm/transparent_hugepage/
enabled``: ``[madvise]``), and torch's allocator never asks. So the tensors are copied into
an anonymous mapping, 2 MiB-aligned, advised ``MADV_HUGEPAGE`` before its pages are touched:
the first write faults them in as huge pages where the kernel has them free (it falls back
to small pages, silently, where it has not: the numbers are the same either way).
"""

from __future__ import annotations

import mmap
import sys
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
ALIGN = 64  # a cache line: the kernels' vector loads never straddle two
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def available() -> bool:
    """Whether this kernel gives huge pages to a mapping that asks (Linux, THP ``always`` or
    ``madvise``)."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        mode = THP_ENABLED.read_text()
    except OSError:
        return False
    return "[always]" in mode or "[madvise]" in mode


def _padded(t: torch.Tensor) -> int:
    return -(-t.numel() * t.element_size() // ALIGN) * ALIGN


def copy_to_huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Contiguous CPU copies of ``tensors`` (same shapes, dtypes and values), one mapping for
    all, each 64-byte aligned. The mapping lives as long as any of the copies."""
    if any(t.device.type != "cpu" for t in tensors):
        raise ValueError("copy_to_huge_pages takes CPU tensors")
    total = sum(_padded(t) for t in tensors)
    if total == 0:
        return [t.clone() for t in tensors]
    size = -(-total // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE  # room to start on a 2 MiB boundary
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    buf = torch.frombuffer(region, dtype=torch.uint8)  # its storage, shared by every copy, holds the mapping
    offset = -buf.data_ptr() % HUGE_PAGE
    out = []
    for t in tensors:
        n = t.numel() * t.element_size()
        view = buf[offset:offset + n].view(t.dtype).view(t.shape)
        view.copy_(t)
        out.append(view)
        offset += _padded(t)
    return out


def huge_page_bytes() -> int:
    """This process's anonymous memory on huge pages (``/proc/self/smaps_rollup``), 0 where
    that is not known."""
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0
