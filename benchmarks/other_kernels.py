"""Another checkout's CPU kernels loaded beside this one's, for A/B timing in one process: on
a machine whose speed moves between minutes, calls made side by side are what compare.

    from benchmarks.other_kernels import load_other
    ops = load_other(Path("/tmp/base"))  # torch.ops.tandem_other: its int4_linear, decode_forward

Builds OTHER/services/engine/cpu_kernels/decode.cpp for this CPU's best instruction set, with
this checkout's flags, under the op namespace ``tandem_other``."""

from __future__ import annotations

import subprocess
from pathlib import Path

import torch

from services.engine.cpu_kernels import build
from services.engine.cpu_kernels import isa as isas


def load_other(checkout: Path, out: Path = Path("/tmp/tandem_other.so")) -> torch._ops._OpNamespace:
    flags = build.cpuinfo_flags()
    isa = isas.best(flags)
    cmd = ["g++", *[f for f in build._flags(isa, isas.cflags(isa, flags)) if not f.startswith("-DTANDEM_OPS")],
           "-DTANDEM_OPS=tandem_other", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
           *(f"-I{p}" for p in build.include_paths()), str(checkout / "services/engine/cpu_kernels/decode.cpp"),
           f"-L{Path(torch.__file__).parent / 'lib'}", "-lc10", "-ltorch_cpu", "-o", str(out)]
    subprocess.run(cmd, check=True)
    torch.ops.load_library(str(out))
    return torch.ops.tandem_other
