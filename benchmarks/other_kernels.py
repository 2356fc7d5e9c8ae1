"""Another checkout's CPU kernels loaded beside this one's, for A/B timing in one process: on
a machine whose speed moves between minutes, calls made side by side are what compare.

    from benchmarks.other_kernels import load_other
    ops = load_other(Path("/tmp/base"))  # torch.ops.tandem_other: its int4_linear, decode_forward

Builds OTHER/services/engine/cpu_kernels/decode.cpp for this CPU's best instruction set, with
this checkout's compiler and flags (build._compile), under the op namespace ``tandem_other``."""

from __future__ import annotations

from pathlib import Path

import torch

from services.engine.cpu_kernels import build
from services.engine.cpu_kernels import isa as isas


def load_other(checkout: Path, out: Path = Path("/tmp/tandem_other.so")) -> torch._ops._OpNamespace:
    flags = build.cpuinfo_flags()
    isa = isas.best(flags)
    build._compile(isa, isas.cflags(isa, flags), out, checkout / "services/engine/cpu_kernels/decode.cpp",
                   namespace="tandem_other")
    torch.ops.load_library(str(out))
    return torch.ops.tandem_other
