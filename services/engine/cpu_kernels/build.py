"""Compiles decode.cpp into a torch op library, once per machine and instruction set
(isa.py), and loads it.

The library is built with the ``g++`` on PATH (``$TANDEM_CXX`` overrides) at first use
(about 15 s) into ``$TANDEM_CACHE_DIR/kernels`` (default ``~/.cache/tandem``), named by a
hash of the source, torch's version, the compiler and its flags: every later engine start
on the machine loads it at once, and an edited kernel never loads a stale build. Builds
are atomic (a temporary file renamed into place), so workers starting together are safe.
``python -m services.engine.cpu_kernels.build`` builds the CPU's best set ahead (``make
setup`` does; ``--all``: every set of the machine's architecture, as the container image does, which then drops g++;
building needs no AVX-512, only running does). Each
set's library registers its ops under its own namespace (``torch.ops.tandem_cpu_<isa>``),
so several load side by side (the tests compare them). Where the CPU lacks the set's
flags, g++ is missing or the build fails, ``load`` raises KernelUnavailable saying why:
the engine keeps torch's own kernels (``engine.cpu_kernels: auto``) or refuses to start
(``true``).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch.utils.cpp_extension import include_paths

from services.common.env import cache_dir
from services.engine.cpu_kernels import isa as isas
from services.engine.cpu_kernels.cpu_features import cpuinfo_flags
from services.engine.cpu_kernels.isa import KernelSet

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode.cpp")
HEADERS = ("simd.h", "pool.h", "weight.h", "matmul_bf16.h", "matmul_int8.h")
CFLAGS = ["-O3", "-std=c++20", "-shared", "-fPIC"]


class KernelUnavailable(RuntimeError):
    """The CPU decode kernels cannot run here; the message says why."""


def _compiler() -> str | None:
    # NOTE: not $CXX: a compiler whose C++ runtime is not the one torch runs with (seen: a
    # second GCC under /opt beside the system's) builds a library that crashes when an op
    # raises. The system g++ is the one torch's wheels are built to work with.
    return os.environ.get("TANDEM_CXX") or shutil.which("g++")


def _flags(isa: str, target: tuple[str, ...], namespace: str | None = None) -> list[str]:
    return [*CFLAGS, *target, f"-DTANDEM_OPS={namespace or KernelSet(isa).namespace}"]


def _library_path(isa: str, target: tuple[str, ...] | None = None) -> Path:
    """Where ``isa``'s build for ``target`` (g++ target flags; default: this CPU's) lives."""
    target = isas.cflags(isa, cpuinfo_flags()) if target is None else target
    key = hashlib.sha256(SOURCE.read_bytes())
    for h in HEADERS:
        key.update(SOURCE.with_name(h).read_bytes())
    key.update(f"{torch.__version__} {_compiler()} {' '.join(_flags(isa, target))}".encode())
    return cache_dir() / "kernels" / f"tandem_cpu_{isa}-{key.hexdigest()[:16]}.so"


def _built(isa: str, target: tuple[str, ...] | None = None) -> Path:
    """The library's path, compiling it first where it is missing."""
    target = isas.cflags(isa, cpuinfo_flags()) if target is None else target
    path = _library_path(isa, target)
    if not path.exists():
        log.info("building the CPU kernels for %s into %s (once per machine) ...", isa, path)
        _compile(isa, target, path)
    return path


def _compile(isa: str, target: tuple[str, ...], out: Path, source: Path = SOURCE, namespace: str | None = None) -> None:
    """g++ ``source`` for ``isa`` into ``out``; ``namespace`` (default: the set's) names its ops
    (an A/B build of another checkout's kernels loads beside this one's under its own)."""
    cxx = _compiler()
    if cxx is None:
        raise KernelUnavailable("no C++ compiler (g++) on PATH")
    torch_lib = Path(torch.__file__).parent / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [cxx, *_flags(isa, target, namespace), f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
           *(f"-I{p}" for p in include_paths()), str(source), f"-L{torch_lib}", "-lc10", "-ltorch_cpu", "-o", tmp]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise KernelUnavailable(f"g++ failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def load(isa: str) -> KernelSet:
    """Build (once per machine) and load ``isa``'s ops. Raises KernelUnavailable naming
    the reason when they cannot run here."""
    if isa not in isas.REQUIRED_FLAGS:
        raise KernelUnavailable(f"no kernels for {isa!r}")
    missing = isas.REQUIRED_FLAGS[isa] - cpuinfo_flags()
    if missing:
        raise KernelUnavailable(f"the CPU lacks {', '.join(sorted(missing))}")
    torch.ops.load_library(str(_built(isa)))
    return KernelSet(isa)


def available(isa: str) -> bool:
    """Whether ``isa``'s kernels are loaded or can be; logs the reason once when not."""
    try:
        load(isa)
    except KernelUnavailable as e:
        _warn_once(f"{isa}: {e}")
        return False
    return True


@functools.cache
def _warn_once(reason: str) -> None:
    log.warning("CPU kernels unavailable (%s): using torch's kernels", reason)


def main(argv: list[str] | None = None) -> int:
    """Build the CPU's best set where it is missing and print its path; with ``--all``,
    every set's every build (an image that drops g++ and runs on other CPUs)."""
    every = "--all" in (sys.argv[1:] if argv is None else argv)
    best = isas.best(cpuinfo_flags())
    if best == "none" and not every:
        print("CPU kernels not built: the CPU has none of " + ", ".join(isas.ISAS), file=sys.stderr)
        return 1
    builds = ([(i, t) for i in isas.for_machine(platform.machine()) for t in isas.every_cflags(i)] if every
              else [(best, None)])
    try:
        for isa, target in builds:
            print(_built(isa, target))
    except KernelUnavailable as e:
        print(f"CPU kernels not built: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
