"""What every bench result carries besides its figures: the exact command line and the
machine it ran on (CPU model, cores, versions, load average), so that a number read months
later says where it came from and whether the machine was quiet.

Kept free of heavy imports (torch's version comes from the package metadata, not an
import): the router and serving benches never load torch.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
from importlib import metadata
from pathlib import Path


def load_average() -> list[float] | None:
    """1, 5 and 15-minute load averages; None where the OS has none."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo (Linux), else what platform knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# The flags that decide which engine kernels a CPU runs (docs/engine.md, "CPU decode kernels").
_KERNEL_FLAGS = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512dq",
                 "avx512_vnni", "avx512_bf16", "amx_bf16", "asimd", "asimddp")


def cpu_flags() -> list[str]:
    """The CPU's flags among those the engine's kernels dispatch on (Linux; else [])."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    have = set(line.split(":", 1)[1].split())
                    return [f for f in _KERNEL_FLAGS if f in have]
    except OSError:
        pass
    return []


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def machine_info() -> dict[str, object]:
    """The machine as a result file records it. ``cores_usable`` is this process's CPU
    affinity (a container or taskset may grant fewer than ``cores``)."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu_model": cpu_model(), "cpu_flags": cpu_flags(), "cores": os.cpu_count(), "cores_usable": usable,
            "arch": platform.machine(), "os": platform.platform(),
            "python": platform.python_version(), "torch": _version("torch"),
            "load_average": load_average()}


def command_line(args: argparse.Namespace) -> str:
    """The `tandem ...` command as typed: services.cli keeps its argv on the namespace
    (``_argv``); sys.argv is the fallback for a handler called some other way."""
    argv = getattr(args, "_argv", None)
    return shlex.join(["tandem", *(sys.argv[1:] if argv is None else argv)])


def header(args: argparse.Namespace) -> dict[str, object]:
    """``command`` and ``machine`` taken before measuring (the load average of that moment)."""
    return {"command": command_line(args), "machine": machine_info()}


def finish(head: dict[str, object], result: dict) -> dict:
    """The result with ``head`` first and the load average after the run."""
    return {**head, "load_average_after": load_average(), **result}


def write_json(path: str | Path | None, result: dict) -> None:
    """Write ``result`` (indented, creating parent directories); a no-op for None."""
    if path is None:
        return
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(result, indent=1) + "\n")
