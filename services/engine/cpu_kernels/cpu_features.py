"""What the CPU can do fast, for ``engine.dtype: auto``.

bfloat16 matmuls only pay on CPUs with native bfloat16 dot products (AVX512-BF16, AMX);
elsewhere oneDNN emulates them and float32 is faster.
"""

from __future__ import annotations

import functools

import torch

_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


@functools.cache
def cpuinfo_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo: its ``flags`` line on x86, ``Features``
    on ARM (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


@functools.cache
def cpu_has_fast_bf16() -> bool:
    """True when the CPU has AVX512-BF16 or AMX: torch's own probe (cpuinfo, what its
    kernels dispatch on), else /proc/cpuinfo's flags where torch lacks the probe."""
    probes = [getattr(torch.cpu, n, None) for n in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    if all(callable(p) for p in probes):
        return any(p() for p in probes)  # type: ignore[misc]
    return bool(_BF16_FLAGS & cpuinfo_flags())
