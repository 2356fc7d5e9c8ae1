"""KV tensors as bytes on the wire (DecodeWorker.KvTransfer): dtype names, chunking, and
reassembly. Torch is imported by the functions that need it only."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# NOTE: names are torch's own (str(dtype) without "torch."), the proto's documented values.
DTYPE_NAMES = ("float32", "bfloat16", "float16")


def dtype_from_name(name: str) -> torch.dtype:
    import torch

    if name not in DTYPE_NAMES:
        raise ValueError(f"unsupported KV dtype {name!r}; expected one of {DTYPE_NAMES}")
    return getattr(torch, name)


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_NAMES:
        raise ValueError(f"unsupported KV dtype {name!r}; expected one of {DTYPE_NAMES}")
    return name


def tensor_bytes(kv: torch.Tensor) -> memoryview:
    """The raw C-contiguous bytes of ``kv`` on the CPU (no copy when already so)."""
    import torch

    t = kv.detach().to("cpu").contiguous()
    # NOTE: view as uint8 so bfloat16 (no numpy dtype) goes through numpy too.
    return memoryview(t.view(torch.uint8).reshape(-1).numpy())


def chunk_ranges(total: int, chunk_bytes: int) -> Iterator[tuple[int, int]]:
    """(offset, end) pairs covering [0, total); one empty range when total is 0."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    if total == 0:
        yield 0, 0
        return
    for off in range(0, total, chunk_bytes):
        yield off, min(off + chunk_bytes, total)
