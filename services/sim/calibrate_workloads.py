"""The workloads `tandem sim calibrate` sends through a real cluster and the simulator.

Each preset names a cluster config (mock-runner workers), its overrides, the bench
workload it sends and its arrival process, sized so the real run takes 1-3 minutes on a
2-core machine (``quick`` sizes take about 15 s). What is sent is built by the bench's own
code (services/bench/workloads.py, arrivals.py), so both sides replay the same requests
at the same send times.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

from services.bench import workloads
from services.bench.arrivals import ArrivalSpec
from services.bench.workloads import BenchRequest

SCALE_MOCK = "configs/scale-mock.yaml"
AGG = "configs/agg.yaml"
XEON_PROFILE = "benchmarks/results/sim/profile_xeon_smollm2.yaml"
CONVERSATION_TRACE = Path("/work/traces/conversation_trace.jsonl")
SYNTHETIC_TRACE = Path("/work/shared/traces/synthetic_trace.jsonl")


@dataclass(frozen=True)
class Preset:
    config: str
    overrides: tuple[str, ...]
    num_requests: int
    quick_requests: int
    rate: float = 0.0  # requests/s of Poisson arrivals; 0: the trace's own times
    speedup: float = 1.0  # trace arrivals only


# NOTE: 8 decode workers in one process everywhere (decode.replicas_per_process), so the
# real cluster's CPU use is the same kind in all three.
_EIGHT = ("decode.replicas=8", "decode.replicas_per_process=8")
PRESETS: dict[str, Preset] = {
    # 8 system prompts of 128 tokens + 32-token questions, 16 output tokens, Poisson 5 req/s
    "chat": Preset(SCALE_MOCK, (*_EIGHT, "prefill.replicas=0"),
                   num_requests=500, quick_requests=60, rate=5.0),
    # 40% 768-token prompts (the rest 64), 32 output tokens, Poisson 2.5 req/s; 6 decode + 2
    # prefill workers (remote prefill above decode.disagg.max_local_prefill_length, 256, by
    # the threshold policy: the predict policy keeps an idle probe local, and the probes
    # measure the remote path)
    "long-disagg": Preset(SCALE_MOCK, ("decode.replicas=6", "decode.replicas_per_process=6",
                                       "prefill.replicas=2", "decode.disagg.enabled=true",
                                       "decode.disagg.policy=threshold"),
                          num_requests=300, quick_requests=40, rate=2.5),
    # whole conversations of a Mooncake trace (hash_ids[1] % M == 0), lengths scaled 1/32 (as
    # the mock-mooncake bench preset), arrivals 30x faster, KV routing (0: the whole sample)
    # the real engine (SmolLM2, 1 thread per worker) on 2 decode workers, simulated with the
    # fitted profile of this machine (give yours with --set engine.step_model=FILE): 8 system
    # prompts of 128 tokens + 32-token questions, 16 output tokens, Poisson 2 req/s
    "real-chat": Preset(AGG, ("prefill.replicas=0", f"engine.step_model={XEON_PROFILE}"),
                        num_requests=120, quick_requests=20, rate=2.0),
    # the real engine on the same 2 workers under long prompts: 40% of 512 tokens (the rest
    # 64), 32 output tokens, Poisson 0.75 req/s. Chunked prefill beside running streams and
    # the ITL target (engine.itl_target_ms) shape its steps, the aggregated layout's case.
    "real-long": Preset(AGG, ("prefill.replicas=0", f"engine.step_model={XEON_PROFILE}"),
                        num_requests=60, quick_requests=12, rate=0.75),
    "conversation": Preset(SCALE_MOCK, (*_EIGHT, "prefill.replicas=0", "router.mode=kv"),
                           num_requests=0, quick_requests=60, speedup=30.0),
}


@dataclass(frozen=True)
class Calibration:
    """One workload, ready to send: the cluster it runs on and what is sent when."""

    name: str
    config: str
    overrides: tuple[str, ...]
    requests: list[BenchRequest]
    arrivals: ArrivalSpec


def default_trace() -> Path:
    """The conversation trace when this machine has it, else the public synthetic one."""
    return CONVERSATION_TRACE if CONVERSATION_TRACE.exists() else SYNTHETIC_TRACE


def sample_conversations(trace: Path, mod: int, out: Path) -> int:
    """Write the rows of ``trace`` whose ``hash_ids[1] % mod == 0`` (whole conversations,
    the rule of the Dynamo replay anchor) to ``out``; returns how many."""
    n = 0
    with open(trace) as src, open(out, "w") as dst:
        for line in src:
            if not line.strip():
                continue
            ids = json.loads(line)["hash_ids"]
            if len(ids) >= 2 and ids[1] % mod == 0:
                dst.write(line if line.endswith("\n") else line + "\n")
                n += 1
    return n


def build(name: str, num_requests: int | None, quick: bool, rate: float | None,
          speedup: float | None, trace: Path | None, sample_mod: int, seed: int,
          overrides: tuple[str, ...] = ()) -> Calibration:
    """The preset ``name`` with the given options in place of its own (None: its own)."""
    p = PRESETS[name]
    n = num_requests if num_requests is not None else (p.quick_requests if quick else
                                                        p.num_requests)
    if name in ("chat", "real-chat"):
        groups = 8
        per = max(1, -(-n // groups))
        reqs = workloads.shared_prefix(groups, per, 128, 32, 16, seed)[:n]
    elif name == "long-disagg":
        reqs = workloads.mixed_lengths(n, 64, 768, 0.4, 32, seed)
    elif name == "real-long":
        reqs = workloads.mixed_lengths(n, 64, 512, 0.4, 32, seed)
    else:
        src = trace or default_trace()
        with tempfile.TemporaryDirectory() as d:
            sampled = Path(d) / "sample.jsonl"
            if not sample_conversations(src, sample_mod, sampled):
                raise ValueError(f"{src}: no conversation has hash_ids[1] % {sample_mod} == 0")
            reqs = workloads.mooncake(sampled, 1 / 32, None, n or None, seed)
    if p.rate:
        spec = ArrivalSpec("poisson", rate=rate or p.rate, seed=seed)
    else:
        spec = ArrivalSpec("trace", speedup=speedup or p.speedup, seed=seed)
    return Calibration(name, p.config, (*p.overrides, *overrides), reqs, spec)
