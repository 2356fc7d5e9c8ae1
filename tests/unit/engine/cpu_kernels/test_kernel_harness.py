"""The int8-path kernels through a torch-free harness (harness/int4_harness.cpp), one
build per instruction set: every x86 set this CPU runs, and NEON (ARMv8.2 dot product)
built by Debian's aarch64 cross compiler and run under qemu-user — how the NEON kernels
are checked on an x86 machine. Each set's matmul matches the float64 references, and all
sets give bit-identical outputs (the same exact int32 dot products, then the same float32
operations in the same order); the elementwise primitives (simd.h) match torch.

What this does not show: NEON's speed (qemu emulates it), and the parts of decode.cpp
beyond simd.h and the matmul on ARM (built for aarch64 in
test_decode_cpp_builds_for_aarch64, not run)."""

from __future__ import annotations

import platform
import shutil
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from services.common.env import in_ci
from services.engine.cpu_kernels import build
from services.engine.cpu_kernels import isa as isas
from services.engine.cpu_kernels.cpu_features import cpuinfo_flags
from services.engine.quant import pack
from services.engine.quant.groups import Int4Groups, from_float
from tests.support.int4_reference import check, gguf_groups

HERE = Path(__file__).parent / "harness"
KERNELS = build.SOURCE.parent
CROSS_CXX, QEMU = "aarch64-linux-gnu-g++", "qemu-aarch64"
INT8_SETS = [i for i in isas.ISAS if i != "avx512_bf16"]


@dataclass(frozen=True)
class Target:
    isa: str
    cxx: list[str]
    run: list[str]  # the prefix that runs a built harness (qemu for a foreign architecture)


def _target(isa: str) -> Target | str:
    """How ``isa``'s harness builds and runs here, or why it cannot."""
    native = isa in isas.for_machine(platform.machine())
    if native:
        missing = isas.REQUIRED_FLAGS[isa] - cpuinfo_flags()
        if missing:
            return f"the CPU lacks {', '.join(sorted(missing))}"
        return Target(isa, ["g++"], []) if shutil.which("g++") else "no g++"
    if isa != "neon":
        return f"{isa} is not this machine's architecture"
    if not (shutil.which(CROSS_CXX) and shutil.which(QEMU)):
        why = f"no {CROSS_CXX} or {QEMU} (Debian: g++-aarch64-linux-gnu, qemu-user; make test installs them)"
        if in_ci():
            pytest.fail(f"CI checks the NEON kernels: {why}")
        return why
    return Target(isa, [CROSS_CXX, "-static"], [QEMU])


@pytest.fixture(scope="module")
def harnesses(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path | str]:
    out = tmp_path_factory.mktemp("harness")
    built: dict[str, Path | str] = {}
    for isa in INT8_SETS:
        t = _target(isa)
        if isinstance(t, str):
            built[isa] = t
            continue
        exe = out / f"int4_harness_{isa}"
        cmd = [*t.cxx, "-O2", "-std=c++20", "-pthread", *isas.cflags(isa, cpuinfo_flags()),
               f"-I{HERE / 'shim'}", f"-I{KERNELS}", str(HERE / "int4_harness.cpp"), "-o", str(exe)]
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)
        built[isa] = exe
    return built


def _run(harnesses: dict[str, Path | str], isa: str, mode: str, payload: bytes, tmp_path: Path) -> bytes:
    exe = harnesses[isa]
    if isinstance(exe, str):
        pytest.skip(exe)
    src, dst = tmp_path / f"{isa}.in", tmp_path / f"{isa}.out"
    src.write_bytes(payload)
    prefix = [QEMU] if isa not in isas.for_machine(platform.machine()) else []
    subprocess.run([*prefix, str(exe), mode, str(src), str(dst)], check=True, timeout=300)
    return dst.read_bytes()


def _matmul(harnesses: dict[str, Path | str], isa: str, x: torch.Tensor, groups: Int4Groups,
            bias: torch.Tensor | None, tmp_path: Path) -> torch.Tensor:
    codes, sm = pack.pack(groups, "quads")
    rows, kx = x.shape
    n = groups.codes.shape[0]
    bf16 = x.dtype == torch.bfloat16
    xbits = x.view(torch.int16).numpy() if bf16 else x.float().numpy()
    head = struct.pack("<7q", rows, kx, n, codes.shape[0], codes.shape[1] // 256, int(bf16), int(bias is not None))
    payload = head + xbits.tobytes() + codes.numpy().tobytes() + sm.view(torch.int16).numpy().tobytes()
    if bias is not None:
        payload += bias.float().numpy().tobytes()
    y = np.frombuffer(_run(harnesses, isa, "matmul", payload, tmp_path), dtype=np.float32)
    return torch.from_numpy(y.copy()).view(rows, n)


def _every_set(harnesses, x, groups, bias, tmp_path) -> dict[str, torch.Tensor]:
    got = {}
    for isa in INT8_SETS:
        if isinstance(harnesses[isa], Path):
            got[isa] = _matmul(harnesses, isa, x, groups, bias, tmp_path)
    return got


def _check_all(got: dict[str, torch.Tensor], x: torch.Tensor, groups: Int4Groups, bias: torch.Tensor | None) -> None:
    assert got, "no kernel set could be built here"
    for isa, y in got.items():
        check(isa, y - (0 if bias is None else bias.float()), x, groups)
    first = next(iter(got.values()))
    for isa, y in got.items():
        assert torch.equal(y, first), f"{isa} differs from {next(iter(got))}"


@pytest.mark.parametrize("isa", INT8_SETS)
def test_each_set_builds_and_runs_or_says_why(harnesses: dict[str, Path | str], isa: str, tmp_path: Path) -> None:
    groups = from_float(torch.randn(16, 32, generator=torch.Generator().manual_seed(1)))
    x = torch.randn(1, 32, generator=torch.Generator().manual_seed(2))
    check(isa, _matmul(harnesses, isa, x, groups, None, tmp_path), x, groups)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 5, 17])
@pytest.mark.parametrize("out_features", [40, 200])
def test_matmul_on_random_weights_every_set_alike(harnesses, dtype, rows: int, out_features: int, tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    groups = from_float(torch.randn(out_features, 96, generator=gen))
    x = torch.randn(rows, 96, generator=gen).to(dtype)
    bias = torch.randn(out_features, generator=gen) if rows % 2 else None
    _check_all(_every_set(harnesses, x, groups, bias, tmp_path), x, groups, bias)


@pytest.mark.parametrize("source", ["Q4_0", "Q4_1", "Q8_0"])
def test_matmul_on_gguf_groupings_every_set_alike(harnesses, source: str, tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(11)
    groups = gguf_groups(source, 130, 576, gen)
    x = torch.randn(9, 576, generator=gen).to(torch.bfloat16)
    _check_all(_every_set(harnesses, x, groups, None, tmp_path), x, groups, None)


def test_matmul_on_the_real_model_every_set_alike(harnesses, smollm2_path: Path, tmp_path: Path) -> None:
    """SmolLM2's own Q4_1 / Q8_0 blocks, exact in the quads layout."""
    from services.engine.weights import load_weights

    quant = load_weights(smollm2_path).quant
    gen = torch.Generator().manual_seed(5)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.7.mlp.down_proj.weight"):
        groups = quant.groups[name]
        x = torch.randn(3, groups.in_features, generator=gen).to(torch.bfloat16)
        _check_all(_every_set(harnesses, x, groups, None, tmp_path), x, groups, None)


@pytest.mark.parametrize("isa", INT8_SETS)
def test_simd_primitives_match_torch(harnesses, isa: str, tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(3)
    count = 256
    x = torch.randn(count, generator=gen) * 20
    x[:4] = torch.tensor([0.5, 1.5, -2.5, 100.0])  # ties round to even; exp clamps past 88
    y = torch.rand(count, generator=gen) * 4 + 0.5
    h = torch.randn(count, generator=gen).half()
    payload = struct.pack("<q", count) + x.numpy().tobytes() + y.numpy().tobytes() + h.view(torch.int16).numpy().tobytes()
    r = torch.from_numpy(np.frombuffer(_run(harnesses, isa, "simd", payload, tmp_path), dtype=np.float32).copy())
    rows = r[: 9 * count].view(9, count)
    torch.testing.assert_close(rows[0], torch.exp(x.clamp(-88, 88)), rtol=4e-6, atol=0)  # degree-6 polynomial
    assert torch.equal(rows[1], torch.round(x))
    assert torch.equal(rows[2], x / y)
    assert torch.equal(rows[3], torch.maximum(x, y)) and torch.equal(rows[4], torch.minimum(x, y))
    torch.testing.assert_close(rows[5], x * y + x, rtol=1e-6, atol=1e-6)
    assert torch.equal(rows[6], h.float())
    assert torch.equal(rows[7], x.bfloat16().float())
    assert torch.equal(rows[8], torch.pow(2.0, torch.round(x).clamp(-126, 127)))
    sums = r[9 * count: 9 * count + count // 16]
    torch.testing.assert_close(sums, x.view(-1, 16).sum(1), rtol=1e-5, atol=1e-4)
    # sum16 (attention's scores, 16 keys at once) adds each vector as sum does, bit for bit
    assert torch.equal(r[9 * count + count // 16:], sums)


def test_decode_cpp_builds_for_aarch64(tmp_path: Path) -> None:
    """The whole op library (norms, rotary, attention, the matmul) compiles for ARMv8.2
    with torch's headers; not run here (no aarch64 torch)."""
    if platform.machine() in ("aarch64", "arm64") or not shutil.which(CROSS_CXX):
        pytest.skip("needs the aarch64 cross compiler on an x86 machine")
    from torch.utils.cpp_extension import include_paths

    cmd = [CROSS_CXX, *build.CFLAGS[:2], "-fPIC", "-c", *isas.cflags("neon", frozenset()),
           "-DTANDEM_OPS=tandem_cpu_neon", *(f"-I{p}" for p in include_paths()), str(build.SOURCE),
           "-o", str(tmp_path / "decode.o")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    dump = subprocess.run(["aarch64-linux-gnu-objdump", "-d", str(tmp_path / "decode.o")],
                          capture_output=True, text=True, check=True).stdout
    assert "sdot" in dump  # the dot-product instruction, not a scalar fallback
