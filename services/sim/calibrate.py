"""`tandem sim calibrate`: how far the simulator is from a real cluster: of mock-runner
workers against the mock step model, or of real-engine workers against a fitted profile
(``engine.step_model``, written by `tandem sim profile` on the same machine).

For each workload (services/sim/calibrate_workloads.py) it starts `tandem up` of the
workload's config, measures at idle what the simulator models as constants (the request
overhead and the remote-prefill path: ``measure_overheads``), sends the workload as `tandem
bench serve` does and stops the cluster; then it simulates the same requests at the same
send times with the same config and those constants, and compares every figure
(services/sim/calibrate_compare.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import numpy as np

from services.bench.arrivals import schedule
from services.bench.client import RequestRecord as BenchRecord
from services.bench.client import RunResult, request_body, run_workload, send
from services.bench.cluster import running_cluster
from services.bench.metrics import request_latencies, summarize
from services.bench.results import header, load_average, write_json
from services.bench.workloads import BenchRequest, oracle_hit_rate
from services.common.config import ClusterConfig, load_config
from services.engine.runner.cpu_decode import ONE_CALL_PREFILL_TOKENS
from services.launcher.up import served_name
from services.sim.calibrate_compare import (
    REAL_TARGET_PCT,
    TARGET_PCT,
    Figures,
    Row,
    compare,
    rows_json,
    table,
)
from services.sim.calibrate_workloads import Calibration, build
from services.sim.profile_check import ProfileCheck
from services.sim.records import SimResult
from services.sim.report import summary
from services.sim.simulator import simulate
from services.sim.traces import from_bench
from services.steptime.model import BatchShape, ScaledStepModel, StepModel
from services.steptime.profile import SHIPPED_CPU_PROFILE, ProfileStepModel, step_model_for

REPO = Path(__file__).resolve().parents[2]
PROBE_LEN = 8  # prompt tokens of an overhead probe
REMOTE_PROBE_EXTRA = 64  # a remote probe's tokens beyond decode.disagg.max_local_prefill_length
# The mock runner's KV per token: K and V of one layer, one head of one float32 dim
# (services/engine/runner/mock_runner.py), what a remote prefill moves.
MOCK_KV_BYTES_PER_TOKEN = 2 * 4
_REMOTE_METRIC = re.compile(r'^tandem_worker_prefill_total\{where="remote"\} ([0-9.e+-]+)$',
                            re.MULTILINE)
_STEP_SECONDS_METRIC = re.compile(
    r'^tandem_worker_engine_step_(modelled|timed)_seconds_total\{kind="(\w+)"\} ([0-9.e+-]+)$',
    re.MULTILINE)
FITS = ("decode", "prefill", "rows")


def step_s(model: StepModel, prompt_len: int) -> float:
    """What the modelled device takes for one probe's prefill (its one step)."""
    return model.step_seconds(BatchShape(prefill_tokens=prompt_len,
                                         prefill_context=prompt_len * prompt_len))


async def _probe(url: str, model: str, n: int, prompt_len: int, warmup: int,
                 timeout_s: float) -> list[float]:
    """TTFT in seconds of ``n`` 1-token requests of ``prompt_len`` tokens sent one after
    the other (``warmup`` more first, not counted: the first requests through a fresh
    cluster open its connections)."""
    rng = np.random.default_rng(12345 + prompt_len)
    key = os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    out: list[float] = []
    async with httpx.AsyncClient(headers=headers, timeout=timeout_s) as client:
        for i in range(n + warmup):
            # NOTE: unique prompts: a prefix hit would shorten the step subtracted.
            prompt = tuple(int(x) for x in rng.integers(1000, 30000, prompt_len))
            rec = BenchRecord(i, prompt_len)
            await send(client, url + "/v1/completions",
                       request_body(BenchRequest(i, prompt, 1), model, "completions"), rec,
                       timeout_s)
            if not rec.ok or rec.first_token_time is None:
                raise RuntimeError(f"overhead probe failed: {rec.error}")
            if i >= warmup:
                out.append(rec.first_token_time - rec.send_time)
            await asyncio.sleep(0.05)
    return out


@dataclass(frozen=True)
class Overheads:
    """What the simulator is told of the running cluster, measured at idle.

    ``request_s``: frontend + processor + router + streaming (``sim.request_overhead_s``):
    the median TTFT of tiny 1-token prompts less their modelled step. ``remote_s``: the remote
    prefill's path beyond that and the prefill itself (queue publish and pull, KV send and
    import: ``sim.kv_transfer_latency_s``): the median TTFT of 1-token prompts just over
    ``decode.disagg.max_local_prefill_length`` less ``request_s`` and their prefill step;
    None without remote prefill."""

    request_s: float
    remote_s: float | None
    probe_ttft_s: list[float]
    remote_probe_ttft_s: list[float]


def measure_overheads(url: str, cfg: ClusterConfig, model: str, n: int,
                      timeout_s: float) -> Overheads:
    mock = step_model_for(cfg)
    ttfts = asyncio.run(_probe(url, model, n, PROBE_LEN, 3, timeout_s))
    request_s = max(0.0, statistics.median(ttfts) - step_s(mock, PROBE_LEN))
    if not (cfg.prefill.replicas and cfg.decode.disagg.enabled):
        return Overheads(request_s, None, ttfts, [])
    long = cfg.decode.disagg.max_local_prefill_length + REMOTE_PROBE_EXTRA
    before = remote_prefills(cfg)
    remote = asyncio.run(_probe(url, model, n, long, 1, timeout_s))
    after = remote_prefills(cfg)
    if before is None or after is None or after - before != n + 1:
        raise RuntimeError(f"remote-prefill probes: {after} - {before} prefilled remotely, "
                           f"not {n + 1}")
    remote_s = max(0.0, statistics.median(remote) - request_s - step_s(mock, long))
    return Overheads(request_s, remote_s, ttfts, remote)


def worker_metrics(cfg: ClusterConfig, prefill: bool = False) -> list[str] | None:
    """The /metrics text of every decode worker of the running cluster (and with
    ``prefill``, every prefill worker); None when one cannot be read."""
    ports = [cfg.decode.metrics_port + i for i in range(cfg.decode.replicas)]
    if prefill:
        ports += [cfg.prefill.metrics_port + i for i in range(cfg.prefill.replicas)]
    texts = []
    for port in ports:
        try:
            texts.append(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5.0).text)
        except httpx.HTTPError:
            return None
    return texts


def remote_prefills(cfg: ClusterConfig) -> int | None:
    """Remote prefills the running cluster's decode workers counted
    (``tandem_worker_prefill_total{where="remote"}``, summed over replicas); None when a
    worker's /metrics cannot be read."""
    texts = worker_metrics(cfg)
    if texts is None:
        return None
    total = 0.0
    for text in texts:
        m = _REMOTE_METRIC.search(text)
        total += float(m.group(1)) if m else 0.0
    return int(total)


def step_seconds(cfg: ClusterConfig) -> dict[tuple[str, str], float] | None:
    """The engine workers' step seconds as modelled and as timed, by fit, summed over
    every decode and prefill replica (``tandem_worker_engine_step_{modelled,timed}_seconds``);
    None when a worker's /metrics cannot be read or exports none (no ITL target, the mock
    runner)."""
    texts = worker_metrics(cfg, prefill=True)
    if texts is None:
        return None
    total: dict[tuple[str, str], float] = {}
    for text in texts:
        found = _STEP_SECONDS_METRIC.findall(text)
        if not found:
            return None
        for what, fit, value in found:
            total[what, fit] = total.get((what, fit), 0.0) + float(value)
    return total


def cluster_speeds(before: dict[tuple[str, str], float] | None,
                   after: dict[tuple[str, str], float] | None) -> dict[str, float] | None:
    """Timed over modelled seconds of each fit between two readings of ``step_seconds``,
    for the fits some step used; None without both readings."""
    if before is None or after is None:
        return None
    out = {}
    for fit in FITS:
        modelled = after.get(("modelled", fit), 0.0) - before.get(("modelled", fit), 0.0)
        timed = after.get(("timed", fit), 0.0) - before.get(("timed", fit), 0.0)
        if modelled > 0:
            out[fit] = timed / modelled
    return out


def at_speeds(model: StepModel, speeds: dict[str, float]) -> ScaledStepModel:
    """``model`` at a cluster's measured speeds (1 for a fit no step used). Where the workers
    ran row steps, a step with up to the CPU kernels' row limit of prefill tokens is one (what
    their ``rows`` fit timed); elsewhere (a CUDA runner) every prefill step is ``prefill``'s."""
    prefill = speeds.get("prefill", 1.0)
    rows = "rows" in speeds
    return ScaledStepModel(model, speeds.get("decode", 1.0), prefill, speeds.get("rows", prefill),
                           model.row_tokens or (ONE_CALL_PREFILL_TOKENS if rows else 0))


BACKGROUND_S = 3.0  # how long the CPU use before a cluster starts is measured


def busy_cpus(seconds: float = BACKGROUND_S) -> float:
    """The CPUs this machine kept busy over ``seconds`` (/proc/stat: all but idle and
    iowait, so a hypervisor's steal counts): what runs beside the cluster to be measured."""
    def read() -> tuple[int, int]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v) - v[3] - v[4], sum(v)

    busy0, all0 = read()
    time.sleep(seconds)
    busy1, all1 = read()
    return (os.cpu_count() or 1) * (busy1 - busy0) / max(1, all1 - all0)


def host_share(arg: str, runner: str) -> tuple[float, float | None]:
    """``sim.host_cpus`` and ``sim.host_background`` for a workload (``--host-cpus``):
    ``auto``, this machine's CPUs and those busy just before the cluster starts (0 and 0 for
    mock-runner workers, whose steps sleep; None where /proc/stat cannot be read, which
    ``sim_config`` takes as none); or the number given, with no background."""
    if arg != "auto":
        return float(arg), 0.0
    if runner == "mock":
        return 0.0, 0.0
    try:
        return float(os.cpu_count() or 1), busy_cpus()
    except OSError:  # not Linux
        return float(os.cpu_count() or 1), None


def step_noise(arg: str, runner: str, model: StepModel) -> float:
    """``sim.step_noise`` for a workload (``--step-noise``): the number given, or (``auto``)
    the scatter of the profile's measured steps around its fit, its mean relative error as
    the standard deviation of a normal scatter (x sqrt(pi / 2)); 0 for mock-runner workers
    (their steps take their model's time exactly) and a model that is not a measured
    profile."""
    if arg != "auto":
        return float(arg)
    if runner != "mock" and isinstance(model, ProfileStepModel):
        return min(1.0, model.error.mean * math.sqrt(math.pi / 2))
    return 0.0


def sim_config(cal: Calibration, config: str, ov: Overheads, cpus: float = 0.0,
               background: float = 0.0, noise: float = 0.0) -> ClusterConfig:
    """The real run's config, with what the simulator needs to know of that cluster."""
    extra = [f"sim.request_overhead_s={ov.request_s:.6f}", f"sim.host_cpus={cpus:g}",
             f"sim.host_background={background:.3f}", f"sim.step_noise={noise:.4f}"]
    if ov.remote_s is not None:
        extra.append(f"sim.kv_transfer_latency_s={ov.remote_s:.6f}")
    base = load_config(config, list(cal.overrides))
    if base.engine.runner == "mock":
        extra.append(f"sim.kv_bytes_per_token={MOCK_KV_BYTES_PER_TOKEN}")
    # NOTE: the run's own --set values last: one naming a sim key wins over the above.
    return load_config(config, [*extra, *cal.overrides])


def run_real(cal: Calibration, config: str, args: argparse.Namespace, log_dir: Path
             ) -> tuple[RunResult, Overheads, int | None, dict[str, float] | None]:
    cfg = load_config(config, list(cal.overrides))
    url = f"http://127.0.0.1:{cfg.frontend.port}"
    model = served_name(cfg)
    with running_cluster(config, cal.overrides, url, log_dir / cal.name,
                         log_dir / f"{cal.name}.log", args.ready_timeout, 2.0):
        ov = measure_overheads(url, cfg, model, args.probes, args.timeout)
        print(f"  request overhead {ov.request_s * 1e3:.1f} ms (median probe TTFT "
              f"{statistics.median(ov.probe_ttft_s) * 1e3:.1f} ms less a "
              f"{step_s(step_model_for(cfg), PROBE_LEN) * 1e3:.1f} ms modelled step)",
              flush=True)
        if ov.remote_s is not None:
            print(f"  remote-prefill path {ov.remote_s * 1e3:.1f} ms (median remote probe TTFT "
                  f"{statistics.median(ov.remote_probe_ttft_s) * 1e3:.1f} ms)", flush=True)
        seconds_before = step_seconds(cfg) if cfg.engine.runner != "mock" else None
        run = asyncio.run(run_workload(url, model, cal.requests, cal.arrivals,
                                       timeout_s=args.timeout,
                                       api_key=os.environ.get("OPENAI_API_KEY")))
        remote = remote_prefills(cfg) if cfg.prefill.replicas else 0
        speeds = cluster_speeds(seconds_before, step_seconds(cfg) if seconds_before else None)
    if remote is not None and ov.remote_s is not None:
        remote -= len(ov.remote_probe_ttft_s) + 1  # the probes' own
    return run, ov, remote, speeds


def run_sim(cal: Calibration, cfg: ClusterConfig, model: StepModel | None = None) -> SimResult:
    """The workload simulated on ``cfg`` with ``model`` (None: the one the config names)."""
    times = schedule(cal.arrivals, len(cal.requests), None, [r.arrival_s for r in cal.requests])
    assert times is not None  # every preset has a schedule
    return simulate(cfg, from_bench(cal.requests, times), model or step_model_for(cfg),
                    lambda r: list(r.prompt or ()))


def per_request(run: RunResult, result: SimResult) -> list[dict]:
    """Each request's TTFT and cached tokens, real beside simulated (ms)."""
    sim = {r.index: r for r in result.records}
    rows = []
    for r in run.records:
        s = sim[r.index]
        real_ttft = request_latencies(r)[0] if r.ok else None
        rows.append({"index": r.index, "prompt_tokens": r.prompt_tokens,
                     "real_ttft_ms": real_ttft, "sim_ttft_ms": s.ttft_s * 1e3 if s.completed else None,
                     "real_cached": r.cached_tokens, "sim_cached": s.cached_tokens,
                     "sim_worker": s.worker, "sim_remote": s.remote, "real_error": r.error or None,
                     "sim_error": s.error})
    return rows


def calibrate_one(cal: Calibration, args: argparse.Namespace, log_dir: Path) -> tuple[list[Row], dict]:
    config = args.config or str(REPO / cal.config)
    print(f"== {cal.name}: {len(cal.requests)} requests, {config} "
          f"{' '.join(cal.overrides)}", flush=True)
    load_before = load_average()
    base = load_config(config, list(cal.overrides))
    cpus, background = host_share(args.host_cpus, base.engine.runner)
    if cpus:
        busy = (f"{background:.2f}" if background is not None
                else "an unknown number (no /proc/stat: none assumed)")
        print(f"  the workers share {cpus:g} CPUs with {busy} busy before the cluster "
              "(sim.host_cpus, sim.host_background)", flush=True)
    noise = step_noise(args.step_noise, base.engine.runner, step_model_for(base))
    if noise:
        print(f"  a step's time scatters {noise:.3f} (sd) around its model (sim.step_noise)",
              flush=True)
    run, ov, real_remote, speeds = run_real(cal, config, args, log_dir)
    real_sum = summarize(run.records, run.duration_s)
    if real_sum.failed:
        print(f"  real run: {real_sum.failed} requests failed {real_sum.errors}", flush=True)
    cfg = sim_config(cal, config, ov, cpus, background or 0.0, noise)
    result = run_sim(cal, cfg)
    real, sim = Figures.of_bench(real_sum), Figures.of_sim(summary(result))
    rows = compare(cal.name, real, sim,
                   TARGET_PCT if cfg.engine.runner == "mock" else REAL_TARGET_PCT)
    sim_remote = sum(r.remote for r in result.records)
    if cfg.prefill.replicas:
        print(f"  remote prefills: real {real_remote}, simulated {sim_remote}", flush=True)
    detail = {"config": config, "overrides": list(cal.overrides), "requests": len(cal.requests),
              "overheads": asdict(ov),
              "real": asdict(real), "sim": asdict(sim), "rows": rows_json(rows),
              "oracle_hit_rate": oracle_hit_rate([r.prompt_ids for r in cal.requests],
                                                 cfg.engine.block_size),
              "remote_prefills": {"real": real_remote, "sim": sim_remote},
              "real_duration_s": run.duration_s, "sim_wall_s": result.wall_s,
              "host_cpus": cfg.sim.host_cpus, "host_background": cfg.sim.host_background,
              "step_noise": cfg.sim.step_noise,
              "load_average_1m": {"before": load_before, "after": load_average()},
              "per_request": per_request(run, result)}
    if speeds is not None:
        # The same simulation with the device at the speed the cluster's steps ran: what is
        # left is the simulator's model of scheduling and queueing, not the profile's speed
        # (nor CPU sharing: the speeds hold it already).
        at_cfg = cfg.model_copy(update={"sim": cfg.sim.model_copy(update={"host_cpus": 0.0})})
        at = run_sim(cal, at_cfg, at_speeds(step_model_for(cfg), speeds))
        print("  the cluster's steps ran at " + ", ".join(f"{k} {v:.3f}" for k, v in speeds.items())
              + " x the profile", flush=True)
        at_rows = compare(f"{cal.name} @ cluster speed", real, Figures.of_sim(summary(at)),
                          REAL_TARGET_PCT)
        rows += at_rows
        detail["cluster_speeds"] = speeds
        detail["at_cluster_speed"] = {"sim": asdict(Figures.of_sim(summary(at))),
                                      "rows": rows_json(at_rows)}
    return rows, detail


# The lines of a failed check's stderr an error message carries (a traceback's last ones
# name the exception).
CHECK_STDERR_LINES = 12


class ProfileCheckError(RuntimeError):
    """`tandem sim profile --check` ended without a verdict: its exit code and the last
    lines of its stderr."""


def check_in_subprocess(config: str, overrides: list[str], path: str) -> ProfileCheck:
    """The verdict of `tandem sim profile --check path --json FILE` with this config, run in
    a process of its own: an engine built here would stay in this process (its threads and
    memory) beside the cluster being measured. ProfileCheckError when it gives none."""
    with tempfile.TemporaryDirectory(prefix="tandem-check-") as tmp:
        out = Path(tmp) / "check.json"
        argv = [sys.executable, "-m", "services.cli", "sim", "profile", "-c", config,
                "--check", path, "--json", str(out)]
        for o in overrides:
            argv += ["--set", o]
        done = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, check=False)
        # NOTE: exit 1 is a stale profile, and also an uncaught exception: the file tells.
        if done.returncode in (0, 1) and out.exists():
            return ProfileCheck.from_json(json.loads(out.read_text()))
    tail = "\n".join("  " + line for line in done.stderr.rstrip().splitlines()[-CHECK_STDERR_LINES:])
    raise ProfileCheckError(f"checking the profile {path} against this machine failed "
                            f"(tandem sim profile --check exited {done.returncode})"
                            + (f":\n{tail}" if tail else ", printing nothing on stderr"))


def profile_checks(cals: list[Calibration], config: str | None) -> dict[str, dict]:
    """``tandem sim profile --check`` of each real-engine workload's profile, once a file:
    a profile measured on another machine (or another instance of this CPU) makes the
    calibration measure the profile's age, not the simulator. Warns when one is stale."""
    out: dict[str, dict] = {}
    for cal in cals:
        cfg_path = config or str(REPO / cal.config)
        cfg = load_config(cfg_path, list(cal.overrides))
        path = str(SHIPPED_CPU_PROFILE if cfg.engine.step_model == "auto" else cfg.engine.step_model)
        if cfg.engine.runner == "mock" or cfg.engine.step_model == "mock" or path in out:
            continue
        print(f"== checking {path} against this machine (tandem sim profile --check)", flush=True)
        verdict = check_in_subprocess(cfg_path, list(cal.overrides), path)
        out[path] = verdict.to_json()
        print(f"  mean error {verdict.mean_error * 100:.1f}%, max {verdict.max_error * 100:.1f}%"
              + ("  WARNING: stale here; profile this machine again (tandem sim profile --out)"
                 if verdict.stale else ""), flush=True)
    return out


def main(args: argparse.Namespace) -> int:
    head = header(args)
    names = args.workloads or ["chat", "long-disagg", "conversation"]
    try:
        cals = [build(n, args.num_requests, args.quick, args.rate, args.speedup,
                      Path(args.trace) if args.trace else None, args.sample_mod, args.seed,
                      tuple(args.overrides)) for n in names]
        for cal in cals:
            cfg = load_config(args.config or str(REPO / cal.config), list(cal.overrides))
            if cfg.engine.runner != "mock" and cfg.engine.step_model == "mock":
                raise ValueError(
                    f"{cal.name}: engine.runner is {cfg.engine.runner!r} but engine.step_model is "
                    "mock: name a profile of this engine on this machine (tandem sim profile)")
            step_model_for(cfg)  # a missing or bad profile fails here, before any cluster
        checks = {} if args.skip_profile_check else profile_checks(cals, args.config)
    except (ValueError, OSError, ProfileCheckError) as e:
        print(f"tandem sim calibrate: {e}", file=sys.stderr)
        return 2
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    details: dict[str, dict] = {}
    for cal in cals:
        r, details[cal.name] = calibrate_one(cal, args, log_dir)
        rows += r
        print(table(r), flush=True)
    if len(cals) > 1:
        print(f"\n{table(rows)}")
    write_json(args.json_path, {**head, "rows": rows_json(rows), "profile_checks": checks,
                                "workloads": details})
    return 0
