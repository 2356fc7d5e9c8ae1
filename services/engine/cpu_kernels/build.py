"""Compiles decode.cpp into a torch op library once per machine and loads it.

The library is built with the ``g++`` on PATH (``$TANDEM_CXX`` overrides) at first use
(about 15 s) into ``$TANDEM_CACHE_DIR/kernels`` (default ``~/.cache/tandem``), named by a
hash of the source, torch's version, the compiler and its flags: every later engine start
on the machine loads it at once, and an edited kernel never loads a stale build. Builds
are atomic (a temporary file renamed into place), so workers starting together are safe.
``python -m services.engine.cpu_kernels.build`` builds it ahead (``make setup`` and the
container image do; building needs no AVX-512, only running does). Where the CPU lacks
the flags, g++ is missing or the build fails, ``load`` raises KernelUnavailable saying
why: the engine keeps torch's own kernels (``engine.cpu_kernels: auto``) or refuses to
start (``true``).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch.utils.cpp_extension import include_paths

from services.common.env import cache_dir
from services.engine.runner.cpu_features import cpuinfo_flags

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode.cpp")
# What decode.cpp's intrinsics need (avx512_bf16: vdpbf16ps; avx512bw: vpermw).
REQUIRED_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "fma", "f16c"})
CFLAGS = ["-O3", "-std=c++20", "-shared", "-fPIC", "-mavx512f", "-mavx512bw", "-mavx512vl",
          "-mavx512dq", "-mavx512bf16", "-mfma", "-mf16c"]


class KernelUnavailable(RuntimeError):
    """The CPU decode kernels cannot run here; the message says why."""


def _compiler() -> str | None:
    # NOTE: not $CXX: a compiler whose C++ runtime is not the one torch runs with (seen: a
    # second GCC under /opt beside the system's) builds a library that crashes when an op
    # raises. The system g++ is the one torch's wheels are built to work with.
    return os.environ.get("TANDEM_CXX") or shutil.which("g++")


def _library_path() -> Path:
    key = hashlib.sha256(SOURCE.read_bytes())
    key.update(f"{torch.__version__} {_compiler()} {' '.join(CFLAGS)}".encode())
    return cache_dir() / "kernels" / f"tandem_cpu-{key.hexdigest()[:16]}.so"


def _built() -> Path:
    """The library's path, compiling it first where it is missing."""
    path = _library_path()
    if not path.exists():
        log.info("building the CPU decode kernels into %s (once per machine) ...", path)
        _compile(path)
    return path


def _compile(out: Path) -> None:
    cxx = _compiler()
    if cxx is None:
        raise KernelUnavailable("no C++ compiler (g++) on PATH")
    torch_lib = Path(torch.__file__).parent / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [cxx, *CFLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *(f"-I{p}" for p in include_paths()),
           str(SOURCE), f"-L{torch_lib}", "-lc10", "-ltorch_cpu", "-o", tmp]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise KernelUnavailable(f"g++ failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def load() -> None:
    """Build (once per machine) and load the ``torch.ops.tandem_cpu`` ops. Raises
    KernelUnavailable naming the reason when they cannot run here."""
    missing = REQUIRED_FLAGS - cpuinfo_flags()
    if missing:
        raise KernelUnavailable(f"the CPU lacks {', '.join(sorted(missing))}")
    torch.ops.load_library(str(_built()))


def available() -> bool:
    """Whether the kernels are loaded or can be; logs the reason once when not."""
    try:
        load()
    except KernelUnavailable as e:
        _warn_once(str(e))
        return False
    return True


@functools.cache
def _warn_once(reason: str) -> None:
    log.warning("CPU decode kernels unavailable (%s): using torch's kernels", reason)


def main() -> int:
    """Build the library where it is missing (whatever this CPU has); print its path."""
    try:
        print(_built())
    except KernelUnavailable as e:
        print(f"CPU kernels not built: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
