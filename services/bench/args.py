"""The parsers of every `tandem bench` subcommand (services/cli.py maps each to its
module's ``main``). Kept free of heavy imports: `tandem --help` builds every parser."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from services.bench.presets import PRESETS, PresetAction, preset_help

WORKLOADS = ("shared-prefix", "multi-turn", "mooncake", "azure", "mixed")
OVERHEAD_LAYERS = "engine,decode,router,processor,http,http_raw"

AddConfig = Callable[[argparse.ArgumentParser], None]


def add_server_args(p: argparse.ArgumentParser) -> None:
    """The running server a bench talks to, both required."""
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="the served model name")


def add_json_arg(p: argparse.ArgumentParser, what: str = "results") -> None:
    p.add_argument("--json", dest="json_path", default=None, metavar="FILE",
                   help=f"write {what} to this file (with the command line and machine info)")


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


def add_sweep_args(p: argparse.ArgumentParser) -> None:
    """``--rates``: drive the cluster at each rate in turn (services/bench/rate_sweep.py)."""
    g = p.add_argument_group("rate sweep")
    g.add_argument("--rates", default=None, metavar="R1,R2,...",
                   help="requests/s: run the workload at each rate in turn on the same cluster "
                        "(instead of --rate) and report SLO attainment per rate and goodput "
                        "(the highest rate meeting --attainment); needs --slo ttft_ms and tpot_ms")
    g.add_argument("--attainment", type=float, default=0.9,
                   help="share of requests that must meet both SLOs for a rate to count")
    g.add_argument("--rate-settle", type=float, default=5.0,
                   help="seconds to wait between rates")


def _engine(sub: argparse._SubParsersAction, add_config: AddConfig) -> None:
    p = sub.add_parser("engine", help="engine prefill/decode tokens/s and matmul GFLOP/s")
    add_config(p)
    add_json_arg(p)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=1000, help="prefill: prompt tokens")
    p.add_argument("--concurrency", default="1,8,32,64", help="decode batch sizes")
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--decode-context", type=int, default=32,
                   help="decode: prompt tokens of each sequence (its context when timing starts)")
    p.add_argument("--overlap", default="",
                   help="on, off or on,off: the overlapped and/or serial step loop, side by "
                        "side (default: engine.overlap of the config)")
    p.add_argument("--runners", default="",
                   help="torch, mock or torch,mock (default: engine.runner of the config)")
    p.add_argument("--decode-sampling", default="greedy", choices=("greedy", "penalties", "logprobs"),
                   help="the decode requests' sampling: greedy, with penalties, or with 5 top "
                        "logprobs per token")
    p.add_argument("--structured", default="none",
                   help="none, json or none,json: decode free, and/or with every sequence "
                        "under a JSON schema (torch runner; reports the mask fill time)")
    p.set_defaults(_key=("bench", "engine"))


def _tp(sub: argparse._SubParsersAction, add_config: AddConfig) -> None:
    p = sub.add_parser("tp", help="tensor parallelism under mixed arrivals: running streams' ITL with and "
                                  "without arrivals, TTFT and output tok/s, sync vs async request broadcast, "
                                  "at each TP size")
    add_config(p)
    add_json_arg(p)
    p.add_argument("--tp", default="1,2,3", help="comma-separated TP sizes (1: the baseline row, no "
                                                 "broadcast; a size the model cannot split is skipped)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of rank 0 (the other ranks: engine.tp_rank_threads)")
    p.add_argument("--requests", type=int, default=24, help="requests per run")
    p.add_argument("--rate", type=float, default=2.0, help="arrivals per second (Poisson, seeded)")
    p.add_argument("--short-len", type=int, default=16, help="prompt tokens of a short request")
    p.add_argument("--long-len", type=int, default=256, help="prompt tokens of a long request")
    p.add_argument("--long-share", type=float, default=0.25, help="share of long requests")
    p.add_argument("--heavy-share", type=float, default=0.5,
                   help="share of requests carrying an image (LLaVA model) or --payload-kib of raw bytes")
    p.add_argument("--payload-kib", type=int, default=4608,
                   help="raw payload of a heavy request on a text model (default: one image's "
                        "embeddings for a 7B LLaVA in 16 bits, 576 x 4096 x 2 bytes)")
    p.add_argument("--output-len", type=int, default=24, help="output tokens per request")
    p.add_argument("--seed", type=int, default=0, help="of the requests and their arrival times")
    p.set_defaults(_key=("bench", "tp"))


def _router(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("router", help="router route latency and event ingest rate")
    add_json_arg(p)
    p.add_argument("--blocks", type=int, default=1_000_000)
    p.add_argument("--workers", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=8000)
    p.add_argument("--routes", type=int, default=2000)
    p.add_argument("--prehashed", action="store_true",
                   help="also time each route with the prompt sent as local block hashes "
                        "(hashed outside the timed call, as processors do)")
    p.set_defaults(_key=("bench", "router"))


def _kv_transfer(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("kv-transfer", help="KV transfer GB/s over loopback: gRPC bytes and /dev/shm, beside a memcpy")
    add_json_arg(p)
    p.add_argument("--tokens", default="1024,2048,4096,8192", help="prompt lengths")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--chunk-bytes", type=int, default=0, help="payload per gRPC message (default: config)")
    p.add_argument("--processes", type=int, default=2, choices=(1, 2),
                   help="2: decode end in a child process (as deployed); 1: all in one process")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="the KV's dtype (as the model holds it)")
    p.set_defaults(_key=("bench", "kv-transfer"))


def _mm_transfer(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("mm-transfer", help="image-embedding transfer GB/s over loopback: gRPC bytes and /dev/shm, with and without resume")
    add_json_arg(p)
    p.add_argument("--rows", default="576,2304", help="embedding rows per image (LLaVA-1.5: 576)")
    p.add_argument("--hidden", type=int, default=4096, help="the text model's hidden size")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--resume-blocks", type=int, default=2,
                   help="first-buffer blocks (128 rows each) of the resume runs")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="the embeddings' dtype (as the model holds them)")
    p.add_argument("--processes", type=int, default=2, choices=(1, 2),
                   help="2: encode worker in a child process (as deployed); 1: all in one process")
    p.set_defaults(_key=("bench", "mm-transfer"))


def _mm_ttft(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("mm-ttft", help="TTFT of image requests under concurrent text load, against a server")
    add_server_args(p)
    add_json_arg(p)
    p.add_argument("--images", type=int, default=20, help="image requests, one after another")
    p.add_argument("--image-size", type=int, default=336, help="square PNG side in pixels")
    p.add_argument("--text-concurrency", type=int, default=4, help="text requests kept in flight meanwhile")
    p.add_argument("--text-tokens", type=int, default=64, help="max_tokens of each text request")
    p.add_argument("--label", default="", help="recorded in the result (e.g. remote-encode)")
    p.set_defaults(_key=("bench", "mm-ttft"))


def _schemas(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("schemas", help="JSON-schema answers over many generated schemas, validated, against a server")
    add_server_args(p)
    add_json_arg(p)
    p.add_argument("--n", type=int, default=50, help="schemas to generate and ask for")
    p.add_argument("--seed", type=int, default=0, help="the schema generator's seed")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=256, help="per answer; a cut answer is invalid")
    p.set_defaults(_key=("bench", "schemas"))


def _serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="stream a workload against an OpenAI-compatible server")
    add_server_args(p)
    add_workload_args(p)
    add_sweep_args(p)
    add_json_arg(p, "results and every request's row")
    p.add_argument("--plot", dest="plot_dir", default=None,
                   help="write TTFT/ITL CDF PNGs here (with --rates: SLO attainment by rate)")
    p.set_defaults(_key=("bench", "serve"))


def _compare(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="the same workload against several cluster configs")
    p.add_argument("--preset", choices=sorted(PRESETS), action=PresetAction, default=None,
                   help=f"runs and workload of a documented table (put it first): {preset_help()}")
    p.add_argument("--run", dest="runs", action="append", default=[],
                   metavar="NAME=FILE[@k=v,...]",
                   help="a cluster to start with `tandem up` (replaces the preset's runs)")
    p.add_argument("--set-all", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override added to every run, e.g. decode.replicas=64")
    add_workload_args(p)
    add_sweep_args(p)
    add_json_arg(p, "all results and every request's row")
    p.add_argument("--summary-json", default=None, metavar="FILE",
                   help="write the results without per-request rows (what benchmarks/results/ keeps)")
    p.add_argument("--plot", dest="plot_dir", default=None,
                   help="write TTFT/ITL CDF PNGs here (with --rates: SLO attainment by rate)")
    p.add_argument("--plot-prefix", default="", help="file name prefix of the plots")
    p.add_argument("--log-dir", default="/tmp/tandem-bench", help="cluster logs and run dirs")
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--settle", type=float, default=2.0, help="seconds to wait after /health")
    p.set_defaults(_key=("bench", "compare"), preset_runs=[])


def _cluster_args(p: argparse.ArgumentParser, run_dir: str, run_dir_help: str) -> None:
    """The cluster a bench runs against: a running one at ``--base-url``, or one it starts
    with ``--up`` (``cluster.cluster_if_asked`` reads these)."""
    p.add_argument("--base-url", default=None,
                   help="the frontend (default: http://127.0.0.1:<frontend.port of the config>)")
    p.add_argument("--up", action="store_true",
                   help="start the cluster from the config (`tandem up`) and stop it after")
    p.add_argument("--run-dir", default=run_dir, help=run_dir_help)
    p.add_argument("--ready-timeout", type=float, default=300.0)


def _overhead(sub: argparse._SubParsersAction, add_config: AddConfig) -> None:
    p = sub.add_parser("overhead", help="time to first token at each layer of a cluster "
                                        "(engine, decode, router, processor, HTTP)")
    add_config(p)
    add_json_arg(p)
    _cluster_args(p, "/tmp/tandem-bench/overhead",
                  "the cluster's run directory (--up), or a running one's (--cpu-per-request)")
    p.add_argument("--n", type=int, default=50, help="measured requests per layer")
    p.add_argument("--warmup", type=int, default=5, help="requests per layer before measuring")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--layers", default=OVERHEAD_LAYERS, help="comma-separated, measured in this order")
    p.add_argument("--cpu-per-request", action="store_true",
                   help="also each cluster process's CPU ms per measured request (needs the run "
                        "dir's processes.json; not for the engine layer)")
    p.set_defaults(_key=("bench", "overhead"))


def _long_prompt(sub: argparse._SubParsersAction, add_config: AddConfig) -> None:
    p = sub.add_parser("long-prompt", help="one very long prompt beside short requests: their "
                                           "TTFT and how often the long one is prefilled")
    add_config(p)
    add_json_arg(p)
    _cluster_args(p, "/tmp/tandem-bench/long-prompt", "the cluster's run directory (--up)")
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--long-tokens", type=int, default=8000)
    p.add_argument("--shorts", type=int, default=20)
    p.add_argument("--short-tokens", type=int, default=64)
    p.add_argument("--short-delay", type=float, default=1.0,
                   help="seconds after the long request before the first short one")
    p.add_argument("--short-interval", type=float, default=3.0,
                   help="seconds between shorts (the default spreads them over a minute: the "
                        "long prompt's whole prefill on 2 CPU cores)")
    p.add_argument("--timeout", type=float, default=600.0, help="per request")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(_key=("bench", "long-prompt"))


def _budget(sub: argparse._SubParsersAction, add_config: AddConfig) -> None:
    p = sub.add_parser("budget", help="the prefill budget study: long and short prompts beside "
                                      "running streams on one engine, swept over the token "
                                      "budget and the ITL target")
    add_config(p)
    add_json_arg(p)
    p.add_argument("--budgets", default="256,1024", help="engine.max_num_batched_tokens values")
    p.add_argument("--itl-targets", default="0,50,100",
                   help="engine.itl_target_ms values (0: off)")
    p.add_argument("--streams", type=int, default=8, help="requests decoding throughout")
    p.add_argument("--requests", type=int, default=12, help="requests arriving beside them")
    p.add_argument("--rate", type=float, default=1.0, help="arrivals per second")
    p.add_argument("--long-share", type=float, default=0.4, help="share of long prompts")
    p.add_argument("--long-tokens", type=int, default=1024)
    p.add_argument("--short-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=16, help="of each arrival")
    p.add_argument("--ref-steps", type=int, default=20, help="decode-only steps timed first")
    p.add_argument("--plot", default=None, metavar="PNG", help="draw the sweep here")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(_key=("bench", "budget"))


def _part_deaths(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("part-deaths", help="kill -9 each part of a running `tandem up` cluster "
                                           "under load: failed requests, seconds to recover")
    p.add_argument("--run-dir", type=Path, required=True, help="tandem up's --run-dir")
    p.add_argument("--up-log", type=Path, required=True, help="where tandem up's output goes")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--parts", default="router,decode-0,prefill-0,processor,frontend,nats")
    p.add_argument("--rate", type=float, default=0.5, help="bench serve requests/s")
    p.add_argument("--long-len", type=int, default=384,
                   help="half the prompts: past decode.disagg.max_local_prefill_length (256), "
                        "so they are prefilled remotely")
    p.add_argument("--num-requests", type=int, default=40)
    p.add_argument("--kill-after", type=float, default=10.0, help="seconds into the load")
    p.add_argument("--settle", type=float, default=5.0, help="seconds between parts, once serving")
    p.add_argument("--watch", type=float, default=40.0,
                   help="seconds after the kill to probe and to wait for the part")
    p.add_argument("--out", type=Path, default=Path("part-deaths"), help="bench serve JSONs")
    p.set_defaults(_key=("bench", "part-deaths"))


def _move(sub: argparse._SubParsersAction, add_config: AddConfig) -> None:
    p = sub.add_parser("move", help="the gap a draining decode worker adds to its streams: "
                                    "moved (KV pulled) against replayed")
    add_config(p)
    add_json_arg(p)
    p.add_argument("--modes", default="move,replay", help="move (drain) and/or replay (server stopped)")
    p.add_argument("--streams", type=int, default=4, help="concurrent streams moved per trial")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=384)
    p.add_argument("--after", type=int, default=8, help="tokens each stream produces before the move")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds for each wait")
    p.set_defaults(_key=("bench", "move"))


def _anchor(sub: argparse._SubParsersAction, add_config: AddConfig) -> None:
    p = sub.add_parser("anchor", help="tandem beside llama.cpp's llama-server on the same GGUF "
                                      "and threads: prefill, decode, served ITL and throughput")
    add_config(p)
    add_json_arg(p)
    p.add_argument("--threads", type=int, default=2, help="both servers' threads")
    p.add_argument("--llama-server", default=None, metavar="PATH",
                   help="the llama-server binary (default: $TANDEM_LLAMA_SERVER, then PATH)")
    p.add_argument("--llama-port", type=int, default=18080)
    p.add_argument("--llama-arg", dest="llama_args", action="append", default=[],
                   metavar="ARG", help="an extra llama-server argument (repeatable; "
                                       "--llama-arg=--flag for one starting with -)")
    p.add_argument("--phases", default="llama,engine,served",
                   help="run these, in this order: llama (llama-server), engine (tandem in "
                        "process), served (tandem up)")
    p.add_argument("--run-dir", default="/tmp/tandem-bench/anchor", help="logs of both servers")
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--bandwidth-mib", type=int, default=512,
                   help="the memory bandwidth copy's size (far above the CPU's caches)")
    w = p.add_argument_group("loads")
    w.add_argument("--prefill-len", type=int, default=850, help="prefill: prompt tokens")
    w.add_argument("--decode-context", type=int, default=32, help="decode: prompt tokens")
    w.add_argument("--decode-tokens", type=int, default=128, help="decode: tokens timed")
    w.add_argument("--itl-prompt", type=int, default=190, help="served: prompt tokens")
    w.add_argument("--itl-out", type=int, default=64, help="served: output tokens")
    w.add_argument("--itl-requests", type=int, default=8, help="served, 1 stream: requests")
    w.add_argument("--streams", type=int, default=32, help="served under load: concurrent streams")
    w.add_argument("--stream-requests", type=int, default=64, help="served under load: requests")
    w.add_argument("--repeats", type=int, default=3, help="prefill/decode: median of this many")
    w.add_argument("--seed", type=int, default=0)
    p.set_defaults(_key=("bench", "anchor"))


def _report(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="markdown rows and CDF plots from `bench compare` JSON files")
    p.add_argument("files", nargs="+", metavar="RESULT.json")
    p.add_argument("--plot", dest="plot_dir", default=None,
                   help="redraw TTFT/ITL CDFs here, named PREFIX + file stem (needs --json files)")
    p.add_argument("--plot-prefix", default="", help="e.g. serving_ (docs/img's names)")
    p.set_defaults(_key=("bench", "report"))


def add_bench_parsers(sub: argparse._SubParsersAction, add_config: AddConfig) -> None:
    """``tandem bench NAME`` for every benchmark; ``add_config`` adds -c/--set as every
    other `tandem` command has them."""
    bench = sub.add_parser("bench", help="benchmarks (docs/benchmarks.md)")
    bs = bench.add_subparsers(dest="bench_command", required=True)
    _engine(bs, add_config)
    _tp(bs, add_config)
    _router(bs)
    _kv_transfer(bs)
    _mm_transfer(bs)
    _mm_ttft(bs)
    _schemas(bs)
    _serve(bs)
    _compare(bs)
    _long_prompt(bs, add_config)
    _budget(bs, add_config)
    _part_deaths(bs)
    _move(bs, add_config)
    _overhead(bs, add_config)
    _anchor(bs, add_config)
    _report(bs)
