"""tandem served against llama-server, both measured by guidellm (the load generator users
benchmark a server with), side by side: 1 stream (inter-token latency) and 32 streams
(output tok/s), 16-token synthetic prompts and 128 output tokens on /v1/completions
(ignore_eos), the default Q4_1 GGUF, 2 threads each. The servers as `tandem bench anchor`
starts them (one engine process each). Rounds alternate which server goes first.

    .venv/bin/python benchmarks/results/guidellm_anchor_2026-11-29/run.py OUT_DIR ROUNDS

Needs .venv-clients (`make bench-clients`) and a llama-server (benchmarks/build_llama_server.sh).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from services.bench.anchor import _SERVED_BASE, find_llama_server, llama_server_argv, running_llama_server
from services.bench.cluster import running_cluster
from services.model.store import default_model_path
from services.model.tokenizer import Tokenizer

GUIDELLM = Path(".venv-clients/bin/guidellm").resolve()
MODEL = "SmolLM2-135M-Instruct"
THREADS, STREAMS = 2, 32
LOADS = (("s1", 1, 8), ("s32", STREAMS, 64))  # name, concurrent streams, requests


def guidellm(url: str, tok: Path, streams: int, count: int, out: Path) -> dict:
    subprocess.run([str(GUIDELLM), "run", "--backend",
                    f"kind=openai_http,target={url},model={MODEL},request_format=/v1/completions",
                    "--tokenizer", f"kind=huggingface_auto,model={tok}",
                    "--profile", f"kind=concurrent,streams={streams}",
                    "--constraint", f"kind=max_requests,count={count}",
                    "--data", "kind=synthetic_text,prompt_tokens=16,output_tokens=128",
                    "--output", f"kind=json,path={out}", "--disable-console"],
                   check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=subprocess.DEVNULL)
    (b,) = json.loads(out.read_text())["benchmarks"]
    m = b["metrics"]
    ok = lambda k: m[k]["successful"]  # noqa: E731
    return {"requests": m["request_totals"], "output_tokens": ok("output_token_count")["total_sum"],
            "output_tok_min": ok("output_token_count")["min"],
            "output_tok_s": ok("output_tokens_per_second")["mean"],
            "itl_ms_mean": ok("inter_token_latency_ms")["mean"],
            "itl_ms_p50": ok("inter_token_latency_ms")["median"],
            "ttft_ms_mean": ok("time_to_first_token_ms")["mean"], "duration_s": b["duration"]}


def measure(url: str, tok: Path, out: Path, tag: str) -> dict:
    guidellm(url, tok, STREAMS, STREAMS, out / f"{tag}_warmup.json")  # first requests: warm-up
    return {name: guidellm(url, tok, streams, count, out / f"{tag}_{name}.json")
            for name, streams, count in LOADS}


def main() -> None:
    out, rounds = Path(sys.argv[1]), int(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    tok = out / "tokenizer"
    gguf = default_model_path()
    Tokenizer.from_path(gguf).save_hf(tok)
    binary = find_llama_server(None)
    assert binary is not None, "no llama-server: benchmarks/build_llama_server.sh"
    llama_url, port = "http://127.0.0.1:8090", 8090
    llama_argv = llama_server_argv(binary, gguf, THREADS, port, STREAMS, 512, MODEL, [])
    tandem_over = [*_SERVED_BASE, f"engine.threads={THREADS}", f"engine.max_num_seqs={STREAMS}"]
    results = []
    for r in range(rounds):
        row: dict = {"round": r}

        def llama() -> None:
            with running_llama_server(llama_argv, llama_url, out / f"llama_{r}.log", 120):
                row["llama"] = measure(llama_url, tok, out, f"llama_{r}")

        def tandem() -> None:
            with running_cluster("configs/local.yaml", tandem_over, "http://127.0.0.1:8000",
                                 out / f"tandem_run_{r}", out / f"tandem_{r}.log", 300, 2.0):
                row["tandem"] = measure("http://127.0.0.1:8000", tok, out, f"tandem_{r}")

        for step in ((llama, tandem) if r % 2 == 0 else (tandem, llama)):
            step()
        row["ratio"] = {"itl_s1": row["tandem"]["s1"]["itl_ms_mean"] / row["llama"]["s1"]["itl_ms_mean"],
                        "tok_s_s32": row["tandem"]["s32"]["output_tok_s"] / row["llama"]["s32"]["output_tok_s"]}
        print(json.dumps(row["ratio"]), flush=True)
        results.append(row)
    (out / "results.json").write_text(json.dumps({"llama_server": str(binary), "argv": llama_argv,
                                                  "tandem_overrides": tandem_over, "rounds": results},
                                                 indent=1))


if __name__ == "__main__":
    main()
