"""The instruction sets our CPU kernels are built for, and ``engine.cpu_isa``.

One build of decode.cpp per set (build.py), each loaded only where the CPU's flags have
it, so no path ever executes an instruction the CPU lacks:

| set           | int4 matmul                                             | code layout |
|---------------|---------------------------------------------------------|-------------|
| avx512_bf16   | bfloat16 activations, ``vdpbf16ps``                     | pairs       |
| avx512_vnni   | int8 activations per 32-group, ``vpdpbusd`` (zmm)       | quads       |
| avx512        | int8 activations, ``vpmaddubsw`` + ``vpmaddwd`` (zmm)   | quads       |
| avx2          | int8 activations, ``vpdpbusd`` ymm with AVX-VNNI, else ``vpmaddubsw`` + ``vpmaddwd`` | quads |
| neon          | int8 activations, ``sdot`` (ARMv8.2 dot product)        | quads       |

``none`` is torch's kernels only. The x86 sets build with x86 g++ flags, ``neon`` with
``-march=armv8.2-a+dotprod``: a machine builds and loads only its own architecture's.
"""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass

ISAS = ("avx512_bf16", "avx512_vnni", "avx512", "avx2", "neon")  # best first (neon: ARM only)
CHOICES = ("auto", *ISAS, "none")
_AVX512 = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c"})
REQUIRED_FLAGS: dict[str, frozenset[str]] = {
    "avx512_bf16": _AVX512 | {"avx512_bf16"},
    "avx512_vnni": _AVX512 | {"avx512_vnni"},
    "avx512": _AVX512,
    "avx2": frozenset({"avx2", "fma", "f16c"}),
    # /proc/cpuinfo's "Features" on aarch64: Advanced SIMD and its dot product
    "neon": frozenset({"asimd", "asimddp"}),
}
_AVX512_CFLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c")


def stands_in_without_bf16(setting: str) -> bool:
    """Whether ``engine.cpu_isa`` forces a set without bfloat16 instructions. Such a set
    stands in for a CPU that has only it, so the engine's dtype and dense-matmul choices
    follow that CPU too: on a CPU with AVX512-BF16, forcing ``avx2`` with bfloat16 dense
    matmuls left in place would prefill on instructions an AVX2 CPU lacks."""
    return setting in REQUIRED_FLAGS and setting != "avx512_bf16"


def cflags(isa: str, flags: Set[str]) -> tuple[str, ...]:
    """The g++ target flags of ``isa``'s build on a CPU with ``flags``."""
    if isa == "avx512_bf16":
        return (*_AVX512_CFLAGS, "-mavx512bf16")
    if isa == "avx512_vnni":
        return (*_AVX512_CFLAGS, "-mavx512vnni")
    if isa == "avx512":
        return _AVX512_CFLAGS
    if isa == "avx2":
        return ("-mavx2", "-mfma", "-mf16c", *(("-mavxvnni",) if "avx_vnni" in flags else ()))
    if isa == "neon":
        return ("-march=armv8.2-a+dotprod",)
    raise ValueError(f"no kernel build for {isa!r}")


def for_machine(machine: str) -> tuple[str, ...]:
    """The sets built for ``machine`` (``platform.machine()``): the x86 sets or neon."""
    return ("neon",) if machine in ("aarch64", "arm64") else tuple(i for i in ISAS if i != "neon")


def every_cflags(isa: str) -> list[tuple[str, ...]]:
    """Every build of ``isa`` some CPU may load (avx2: with and without AVX-VNNI), for an
    image built on one machine and run on others."""
    return list(dict.fromkeys(cflags(isa, flags) for flags in (frozenset(), frozenset({"avx_vnni"}))))


def best(flags: Set[str]) -> str:
    """The fastest set the CPU's flags allow, ``none`` where none does."""
    return next((isa for isa in ISAS if REQUIRED_FLAGS[isa] <= flags), "none")


def resolve(name: str, flags: Set[str]) -> str:
    """``engine.cpu_isa`` -> one of ISAS or ``none``. Raises ValueError for a set the CPU
    lacks (naming the missing flags) or one not built here."""
    if name == "auto":
        return best(flags)
    if name == "none":
        return name
    if name not in REQUIRED_FLAGS:
        raise ValueError(f"engine.cpu_isa={name}: unknown (one of {', '.join(CHOICES)})")
    missing = REQUIRED_FLAGS[name] - flags
    if missing:
        raise ValueError(f"engine.cpu_isa={name}: the CPU lacks {', '.join(sorted(missing))}")
    return name


@dataclass(frozen=True)
class KernelSet:
    """The kernels one instruction set's build offers: its op namespace and code layout."""

    isa: str

    @property
    def namespace(self) -> str:
        return f"tandem_cpu_{self.isa}"

    @property
    def layout(self) -> str:
        """quant/pack.py's code layout: ``pairs`` for vdpbf16ps, ``quads`` for the int8 dot products."""
        return "pairs" if self.isa == "avx512_bf16" else "quads"

    @property
    def float_input(self) -> bool:
        """Whether ``int4_linear`` takes float32 activations (the int8 paths quantize any)."""
        return self.isa != "avx512_bf16"
