"""The workload, arrival and SLO options of `tandem bench serve` and `bench compare`
(kept free of heavy imports: `tandem --help` builds every parser)."""

from __future__ import annotations

import argparse

WORKLOADS = ("shared-prefix", "multi-turn", "mooncake", "azure", "mixed")


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The workload, arrival and SLO options `bench serve` and `bench compare` share."""
    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=WORKLOADS, default="shared-prefix")
    w.add_argument("--num-requests", type=int, default=100, help="send at most this many")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--groups", type=int, default=8, help="shared-prefix: system prompts")
    w.add_argument("--system-len", type=int, default=256, help="shared-prefix/multi-turn: tokens")
    w.add_argument("--question-len", type=int, default=32, help="shared-prefix: tokens")
    w.add_argument("--output-len", type=int, default=16)
    w.add_argument("--turns", type=int, default=4, help="multi-turn: turns per conversation")
    w.add_argument("--user-len", type=int, default=32, help="multi-turn: tokens per user turn")
    w.add_argument("--assistant-len", type=int, default=32, help="multi-turn: tokens per reply")
    w.add_argument("--trace", default=None, help="mooncake (.jsonl) / azure (.csv) trace file")
    w.add_argument("--scale", type=float, default=None,
                   help="trace length scale (mooncake default 1/32: 16-token blocks; azure 1/8)")
    w.add_argument("--output-scale", type=float, default=None, help="default: --scale")
    w.add_argument("--short-len", type=int, default=32, help="mixed: short prompt tokens")
    w.add_argument("--long-len", type=int, default=768, help="mixed: long prompt tokens")
    w.add_argument("--long-fraction", type=float, default=0.25, help="mixed: share of long")
    w.add_argument("--block-size", type=int, default=16, help="KV block size for the oracle")
    a = p.add_argument_group("arrivals")
    a.add_argument("--arrival", choices=("poisson", "gamma", "concurrency", "trace"),
                   default="poisson")
    a.add_argument("--rate", type=float, default=4.0, help="requests/s (poisson, gamma)")
    a.add_argument("--burstiness", type=float, default=1.0, help="gamma shape")
    a.add_argument("--concurrency", type=int, default=8)
    a.add_argument("--speedup", type=float, default=1.0, help="trace: divide timestamps by it")
    a.add_argument("--duration", type=float, default=None, help="stop sending after N seconds")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--slo", action="append", default=[], metavar="KEY=MS",
                   help="goodput SLO, e.g. ttft_ms=500 (keys: ttft_ms tpot_ms itl_ms e2e_ms)")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, s")
