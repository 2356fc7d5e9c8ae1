"""The `tandem` command. Each subcommand's work lives in its part's package; this file
only parses arguments and imports lazily so `tandem --help` stays fast."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# subcommand path -> "module:function"; the function takes the parsed argparse.Namespace.
_HANDLERS = {
    ("model", "pull"): "services.model.store:pull_main",
    ("model", "tokenizer"): "services.model.store:tokenizer_main",
    ("model", "make-tiny-llava"): "services.engine.multimodal.tiny:main",
    ("chat",): "services.engine.chat:main",
    ("router",): "services.router.serve:main",
    ("decode",): "services.decode.serve:main",
    ("prefill",): "services.prefill.serve:main",
    ("encode",): "services.encode.serve:main",
    ("processor",): "services.processor.serve:main",
    ("frontend",): "services.frontend.serve:main",
    ("up",): "services.launcher.up:main",
    ("planner",): "services.planner.serve:main",
    ("bench", "engine"): "services.bench.engine:main",
    ("bench", "tp"): "services.bench.tp:main",
    ("bench", "router"): "services.bench.router:main",
    ("bench", "kv-transfer"): "services.bench.kv_transfer:main",
    ("bench", "mm-transfer"): "services.bench.mm_transfer:main",
    ("bench", "mm-ttft"): "services.bench.mm_ttft:main",
    ("bench", "schemas"): "services.bench.schemas:main",
    ("bench", "serve"): "services.bench.serve:main",
    ("bench", "compare"): "services.bench.compare:main",
    ("bench", "overhead"): "services.bench.overhead:main",
    ("bench", "long-prompt"): "services.bench.long_prompt:main",
    ("bench", "budget"): "services.bench.budget:main",
    ("bench", "part-deaths"): "services.bench.part_deaths:main",
    ("bench", "move"): "services.bench.move:main",
    ("bench", "report"): "services.bench.report:main",
    ("bench", "anchor"): "services.bench.anchor:main",
    ("sim",): "services.sim.replay:main",
    ("sim", "profile"): "services.sim.profiler:main",
    ("sim", "calibrate"): "services.sim.calibrate:main",
    ("sim", "decisions"): "services.sim.decisions:main",
    ("sim", "planner-eval"): "services.sim.planner_eval:main",
}


def _add_config(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--config", default=None, help="cluster YAML (default: built-in defaults)")
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a config key, e.g. --set engine.threads=2 (repeatable)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="tandem: disaggregated LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)

    model = sub.add_parser("model", help="manage the model cache")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    pull = model_sub.add_parser("pull", help="fetch the default model (SmolLM2-135M-Instruct)")
    pull.set_defaults(_key=("model", "pull"))
    tokenizer = model_sub.add_parser(
        "tokenizer", help="write a model's tokenizer as transformers loads it (for guidellm, aiperf, lm-eval)")
    tokenizer.add_argument("dir", help="directory to write tokenizer.json and tokenizer_config.json")
    tokenizer.add_argument("--model", default="auto",
                           help="a .gguf file or Hugging Face directory (default: the default model)")
    tokenizer.set_defaults(_key=("model", "tokenizer"))
    tiny = model_sub.add_parser("make-tiny-llava", help="write a tiny LLaVA model with RANDOM weights (demos, tests)")
    tiny.add_argument("dir", help="directory to write config.json, preprocessor_config.json, model.safetensors")
    tiny.add_argument("--vision", choices=("clip", "siglip"), default="clip")
    tiny.add_argument("--text", choices=("llama", "qwen2"), default="llama")
    tiny.set_defaults(_key=("model", "make-tiny-llava"))

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
        ("encode", "run one encode worker (a LLaVA model's vision tower; gRPC embedding transfer)"),
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

    planner = sub.add_parser("planner", help="move the prefill/decode split with the load (planner.*)")
    _add_config(planner)
    planner.set_defaults(_key=("planner",))

    up = sub.add_parser("up", help="start the whole cluster from a config and supervise it")
    _add_config(up)
    up.add_argument("--only", default=None, metavar="PARTS",
                    help="start only these parts, comma-separated "
                         "(nats,router,encode,decode,prefill,processor,frontend,planner)")
    up.add_argument("--run-dir", default=None,
                    help="logs, pids and NATS's store (default: a fresh dir under the cache)")
    up.add_argument("--ready-timeout", type=float, default=600.0,
                    help="seconds to wait for every part to be ready")
    up.add_argument("--stop-timeout", type=float, default=10.0,
                    help="seconds a child gets to exit after SIGTERM before SIGKILL")
    up.add_argument("--fail-fast", action="store_true",
                    help="stop the whole cluster when any part dies, instead of restarting it "
                         "(for tests and CI)")
    up.set_defaults(_key=("up",))

    from services.bench.args import add_bench_parsers

    add_bench_parsers(sub, _add_config)
    from services.sim.args import add_sim_parsers

    add_sim_parsers(sub, _add_config)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # the exact command line, for the result files of `tandem bench` (services/bench/results.py)
    args._argv = list(sys.argv[1:] if argv is None else argv)
    module, func = _HANDLERS[args._key].split(":")
    from services.common.malloc_tuning import tune_malloc

    tune_malloc()
    if args._key[0] in ("bench", "sim"):
        # a bench terminated by SIGTERM (what `timeout` sends) unwinds like Ctrl-C: the
        # clusters, servers and TP ranks it started are stopped on the way out
        from services.common.children import interrupt_on_sigterm

        interrupt_on_sigterm()
    handler = getattr(importlib.import_module(module), func)
    try:
        return int(handler(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
