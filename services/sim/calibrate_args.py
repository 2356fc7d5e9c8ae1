"""The parser of `tandem sim calibrate`. Kept free of heavy imports: `tandem --help` builds
every parser (the preset names are repeated here rather than imported for that reason)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

AddConfig = Callable[[argparse.ArgumentParser], None]
WORKLOADS = ("chat", "long-disagg", "conversation", "real-chat", "real-long")


def _auto_or_number(v: str, low: float, high: float, what: str) -> str:
    if v == "auto":
        return v
    try:
        if low <= float(v) <= high:
            return v
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"{v!r}: give auto or {what}")


def host_cpus_arg(v: str) -> str:
    """``--host-cpus``: ``auto`` or a number of CPUs >= 0."""
    return _auto_or_number(v, 0.0, float("inf"), "a number of CPUs >= 0")


def step_noise_arg(v: str) -> str:
    """``--step-noise``: ``auto`` or a relative spread in [0, 1]."""
    return _auto_or_number(v, 0.0, 1.0, "a relative spread in [0, 1]")


def add_calibrate_parser(sim_sub: argparse._SubParsersAction, add_config: AddConfig) -> None:
    p = sim_sub.add_parser(
        "calibrate", help="the same workloads through a real mock-worker cluster and the "
                          "simulator: each figure real, simulated and its error",
        description="For each workload: `tandem up` of its config (mock-runner workers, or the real engine against a fitted profile), the "
                    "request overhead (frontend, processor, router) and the remote-prefill "
                    "path measured at idle, the workload sent as `tandem bench serve` sends "
                    "it; then the simulator with the same config, those two "
                    "(sim.request_overhead_s, sim.kv_transfer_latency_s) and the same send "
                    "times. Prints real, simulated and error % for mean and p90 TTFT, mean "
                    "ITL, prefix hit rate (targets: within 10%), mean TPOT and E2E.")
    add_config(p)  # -c replaces every workload's own config file; --set adds to each
    p.add_argument("--workload", dest="workloads", action="append", choices=WORKLOADS,
                   help="repeatable (default: the three of mock workers). chat: short prompts "
                        "over 8 shared system prompts, 8 decode workers; long-disagg: 40%% long "
                        "prompts, 6 decode + 2 prefill workers; conversation: whole "
                        "conversations of a Mooncake trace, 8 decode workers, KV routing; "
                        "real-chat: chat on 2 workers of the real engine against the fitted "
                        "profile in engine.step_model; real-long: 40%% prompts of 512 tokens on "
                        "the same 2 workers (services/sim/calibrate_workloads.py)")
    p.add_argument("--quick", action="store_true", help="small sizes (~15 s of sending each)")
    p.add_argument("--num-requests", type=int, default=None,
                   help="instead of the preset's (conversation: 0 = the whole sample)")
    p.add_argument("--rate", type=float, default=None, help="Poisson req/s (all but conversation)")
    p.add_argument("--speedup", type=float, default=None,
                   help="conversation: trace timestamps divided by it (default 30)")
    p.add_argument("--trace", default=None,
                   help="conversation: Mooncake JSONL (default /work/traces/"
                        "conversation_trace.jsonl if present, else /work/shared/traces/"
                        "synthetic_trace.jsonl)")
    p.add_argument("--sample-mod", type=int, default=24,
                   help="conversation: keep conversations whose hash_ids[1] %% M == 0")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--probes", type=int, default=10,
                   help="1-token requests at idle that measure the request overhead")
    p.add_argument("--skip-profile-check", action="store_true",
                   help="real-engine workloads: do not time the quick grid against their profile "
                        "first (tandem sim profile --check, ~40 s; it warns when the profile "
                        "is stale on this machine)")
    p.add_argument("--host-cpus", default="auto", metavar="N|auto", type=host_cpus_arg,
                   help="sim.host_cpus of the simulated runs: the CPUs the workers share (auto: "
                        "this machine's, with sim.host_background the CPUs busy in the 3 s "
                        "before each cluster starts; mock-runner workloads 0, no sharing)")
    p.add_argument("--step-noise", default="auto", metavar="S|auto", type=step_noise_arg,
                   help="sim.step_noise of the simulated runs: how far a step's time scatters "
                        "around its model (auto: the profile's fit error, as a standard "
                        "deviation; mock-runner workloads 0)")
    p.add_argument("--json", dest="json_path", default=None, metavar="FILE",
                   help="every figure and error, the overhead and per-request TTFTs")
    p.add_argument("--log-dir", default="/tmp/tandem-sim/calibrate",
                   help="each cluster's run directory and log")
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--timeout", type=float, default=600.0, help="per request")
    p.set_defaults(_key=("sim", "calibrate"))
