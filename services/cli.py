"""The `tandem` command. Each subcommand's work lives in its part's package; this file
only parses arguments and imports lazily so `tandem --help` stays fast."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# subcommand path -> "module:function"; the function takes the parsed argparse.Namespace.
_HANDLERS = {
    ("model", "pull"): "services.engine.model_store:pull_main",
    ("chat",): "services.engine.chat:main",
    ("bench", "engine"): "services.engine.bench:main",
    ("bench", "router"): "services.router.bench:main",
    ("router",): "services.router.cli:main",
    ("decode",): "services.decode.serve:main",
    ("prefill",): "services.prefill.serve:main",
    ("processor",): "services.processor.serve:main",
    ("frontend",): "services.frontend.serve:main",
    ("up",): "services.launcher.up:main",
    ("bench", "kv-transfer"): "services.prefill.bench:main",
    ("bench", "serve"): "services.bench.serve_bench:main",
    ("bench", "compare"): "services.bench.compare:main",
}


def _add_config(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--config", default=None, help="cluster YAML (default: built-in defaults)")
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a config key, e.g. --set engine.threads=2 (repeatable)",
    )


def _add_serving_bench(bench_sub: argparse._SubParsersAction) -> None:
    from services.bench.args import add_workload_args

    bs = bench_sub.add_parser("serve", help="stream a workload against an OpenAI-compatible server")
    bs.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    bs.add_argument("--model", required=True, help="the served model name")
    add_workload_args(bs)
    bs.add_argument("--json", dest="json_path", default=None, help="write results to this file")
    bs.add_argument("--plot", dest="plot_dir", default=None, help="write TTFT/ITL CDF PNGs here")
    bs.set_defaults(_key=("bench", "serve"))
    bc = bench_sub.add_parser("compare", help="the same workload against several cluster configs")
    bc.add_argument("--run", dest="runs", action="append", default=[], required=True,
                    metavar="NAME=FILE[@k=v,...]", help="a cluster to start with `tandem up`")
    add_workload_args(bc)
    bc.add_argument("--json", dest="json_path", default=None, help="write all results here")
    bc.add_argument("--plot", dest="plot_dir", default=None, help="write TTFT/ITL CDF PNGs here")
    bc.add_argument("--plot-prefix", default="", help="file name prefix of the plots")
    bc.add_argument("--log-dir", default="/tmp/tandem-bench", help="cluster logs and run dirs")
    bc.add_argument("--ready-timeout", type=float, default=300.0)
    bc.add_argument("--settle", type=float, default=2.0, help="seconds to wait after /health")
    bc.set_defaults(_key=("bench", "compare"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="tandem: disaggregated LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)

    model = sub.add_parser("model", help="manage the model cache")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    pull = model_sub.add_parser("pull", help="fetch the default model (SmolLM2-135M-Instruct)")
    pull.set_defaults(_key=("model", "pull"))

    chat = sub.add_parser("chat", help="chat with a single in-process engine")
    _add_config(chat)
    chat.add_argument("--prompt", default=None, help="answer one prompt and exit")
    chat.add_argument("--max-tokens", type=int, default=256)
    chat.add_argument("--temperature", type=float, default=0.0)
    chat.set_defaults(_key=("chat",))

    router = sub.add_parser("router", help="run one KV-aware router replica")
    _add_config(router)
    router.add_argument("--replica", type=int, default=0, help="replica index: ports are base + N")
    router.set_defaults(_key=("router",))

    for part, help_text in (
        ("decode", "run one decode worker (gRPC Generate and KvTransfer)"),
        ("prefill", "run one prefill worker (pulls the JetStream prefill queue)"),
        ("processor", "run the processor (tokenize, route, stream, detokenize)"),
        ("frontend", "run the OpenAI-compatible HTTP frontend"),
    ):
        p = sub.add_parser(part, help=help_text)
        _add_config(p)
        p.add_argument("--replica", type=int, default=0, help="replica index: ports are base + N")
        if part == "decode":
            p.add_argument("--replicas-in-process", type=int, default=1, metavar="K",
                           help="host replicas N..N+K-1 in this process (mock runner at scale)")
        p.set_defaults(_key=(part,))

    up = sub.add_parser("up", help="start the whole cluster from a config and supervise it")
    _add_config(up)
    up.add_argument("--only", default=None, metavar="PARTS",
                    help="start only these parts, comma-separated "
                         "(nats,router,decode,prefill,processor,frontend)")
    up.add_argument("--run-dir", default=None,
                    help="logs, pids and NATS's store (default: a fresh dir under the cache)")
    up.add_argument("--ready-timeout", type=float, default=600.0,
                    help="seconds to wait for every part to be ready")
    up.add_argument("--stop-timeout", type=float, default=10.0,
                    help="seconds a child gets to exit after SIGTERM before SIGKILL")
    up.set_defaults(_key=("up",))

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    be = bench_sub.add_parser("engine", help="engine prefill/decode tokens/s and matmul GFLOP/s")
    _add_config(be)
    be.add_argument("--json", dest="json_path", default=None, help="write results to this file")
    be.add_argument("--threads", type=int, default=2)
    be.add_argument("--prompt-len", type=int, default=1000)
    be.add_argument("--concurrency", default="1,8,32,64", help="decode batch sizes")
    be.add_argument("--decode-steps", type=int, default=32)
    be.set_defaults(_key=("bench", "engine"))
    br = bench_sub.add_parser("router", help="router route latency and event ingest rate")
    br.add_argument("--json", dest="json_path", default=None, help="write results to this file")
    br.add_argument("--blocks", type=int, default=1_000_000)
    br.add_argument("--workers", type=int, default=64)
    br.add_argument("--prompt-tokens", type=int, default=8000)
    br.add_argument("--routes", type=int, default=2000)
    br.add_argument("--prehashed", action="store_true",
                    help="also time each route with the prompt sent as local block hashes "
                         "(hashed outside the timed call, as processors do)")
    br.set_defaults(_key=("bench", "router"))
    bk = bench_sub.add_parser("kv-transfer", help="KV transfer GB/s over loopback: gRPC bytes and /dev/shm")
    bk.add_argument("--json", dest="json_path", default=None, help="write results to this file")
    bk.add_argument("--tokens", default="1024,2048,4096,8192", help="prompt lengths")
    bk.add_argument("--repeats", type=int, default=5)
    bk.add_argument("--chunk-bytes", type=int, default=0, help="payload per gRPC message (default: config)")
    bk.add_argument("--processes", type=int, default=2, choices=(1, 2),
                    help="2: decode end in a child process (as deployed); 1: all in one process")
    bk.set_defaults(_key=("bench", "kv-transfer"))
    _add_serving_bench(bench_sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    module, func = _HANDLERS[args._key].split(":")
    handler = getattr(importlib.import_module(module), func)
    try:
        return int(handler(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
