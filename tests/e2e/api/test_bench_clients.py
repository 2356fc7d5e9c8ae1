"""guidellm and aiperf, the load generators users benchmark a server with, against the
cluster a user starts (`tandem up -c configs/local.yaml`, the real SmolLM2), and the
prefix-cache reset (`POST /reset_prefix_cache`) aiperf's ``--reset-kv-cache`` calls before
a run; both on the Responses API too. Both tools live in .venv-clients (`make bench-clients`; `make test` makes it): their
pins clash with the project's."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.mock_cluster import MODEL
from tests.support.up import REPO, Up, local_ports, metric, start_up

CLIENTS = REPO / ".venv-clients" / "bin"
LONG = ("The Roman Empire built roads, aqueducts and cities across Europe, and its law shaped "
        "later states. ") * 30  # ~600 tokens: past max_local_prefill_length, prefilled remotely
SHORT = "Write one sentence about the sea, and one about the mountains, and stop. " * 4


def tool(name: str) -> Path:
    path = CLIENTS / name
    if not path.exists():
        pytest.skip(f"{path} missing: run `make bench-clients`")
    return path


def until(check: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.2)


class Cluster:
    def __init__(self, base: str, ports: dict[str, int]) -> None:
        self.base = base
        self.decode_m = f"http://127.0.0.1:{ports['decode_m']}/metrics"
        self.prefill_m = f"http://127.0.0.1:{ports['prefill_m']}/metrics"
        self.router_m = f"http://127.0.0.1:{ports['router_m']}/metrics"

    def cached_tokens(self, prompt: str) -> int:
        r = httpx.post(self.base + "/v1/completions", timeout=300, json={
            "model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    def idle(self) -> bool:
        """No request running or holding a KV block anywhere (nothing leaked)."""
        return all(metric(url, name) == 0 for url in (self.decode_m, self.prefill_m)
                   for name in ("tandem_worker_kv_blocks_used", "tandem_worker_requests_running",
                                "tandem_worker_requests_waiting"))

    def resets(self) -> float:
        return metric(self.decode_m, "tandem_worker_prefix_cache_resets_total")


@pytest.fixture(scope="module")
def cluster(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    ports, overrides = local_ports()
    up: Up = start_up(REPO / "configs" / "local.yaml", tmp_path_factory.mktemp("run"),
                      ["--ready-timeout", "300", "--fail-fast"], overrides)
    base = f"http://127.0.0.1:{ports['front']}"
    try:
        up.wait_healthy(base)
        yield Cluster(base, ports)
    finally:
        up.stop()


@pytest.fixture(scope="module")
def tokenizer_dir(smollm2_tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The served model's tokenizer as transformers loads it (both tools count tokens)."""
    d = tmp_path_factory.mktemp("tokenizer")
    smollm2_tokenizer.save_hf(d)  # what `tandem model tokenizer DIR` writes
    return d


def run_tool(args: list[str], cwd: Path, offline: bool = True) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    out = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, f"{args[0]} failed ({out.returncode}):\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"


def aiperf_profile(cluster: Cluster, tokenizer_dir: Path, tmp_path: Path, endpoint: str, *,
                   concurrency: int, count: int, isl: int, osl: int, seed: int,
                   extra: list[str] | None = None) -> dict:
    """aiperf's streamed run of fixed-length synthetic prompts (ignore_eos: every answer runs
    to ``osl`` tokens) counted with the server's usage; its summary."""
    # NOTE: not offline: aiperf 0.13 resolves a local tokenizer directory through the hub
    # cache when HF_HUB_OFFLINE is set, and fails; online it loads the directory directly.
    run_tool([str(tool("aiperf")), "profile", "--model", MODEL, "--url", cluster.base,
              "--endpoint-type", endpoint, "--streaming", "--tokenizer", str(tokenizer_dir),
              "--concurrency", str(concurrency), "--request-count", str(count),
              "--prompt-input-tokens-mean", str(isl), "--prompt-input-tokens-stddev", "0",
              "--prompt-output-tokens-mean", str(osl), "--prompt-output-tokens-stddev", "0",
              "--extra-inputs", "ignore_eos:true", "--use-server-token-count",
              "--random-seed", str(seed), "--output-artifact-dir", str(tmp_path / "out"),
              "--ui-type", "none", *(extra or [])], tmp_path, offline=False)
    return json.loads((tmp_path / "out" / "profile_export_aiperf.json").read_text())


def test_reset_prefix_cache_empties_every_workers_cache_and_the_routers_index(cluster: Cluster) -> None:
    cluster.cached_tokens(LONG)  # prefilled on the prefill worker, which keeps its blocks
    cluster.cached_tokens(SHORT)
    assert cluster.cached_tokens(SHORT) > 0
    until(lambda: metric(cluster.router_m, "tandem_router_indexed_blocks") > 0)
    assert metric(cluster.prefill_m, "tandem_worker_kv_blocks_cached") > 0
    before = cluster.resets()

    r = httpx.post(cluster.base + "/reset_prefix_cache", timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    by_id = {w["id"]: w for w in body["workers"]}
    assert set(by_id) == {"decode-0", "prefill-0"}
    assert by_id["decode-0"]["evicted_blocks"] > 0 and by_id["prefill-0"]["evicted_blocks"] > 0
    assert body["evicted_blocks"] == sum(w["evicted_blocks"] for w in body["workers"])
    assert all(w["blocks_in_use"] == 0 for w in body["workers"])  # nothing was running

    for url in (cluster.decode_m, cluster.prefill_m):
        assert metric(url, "tandem_worker_kv_blocks_cached") == 0
    until(lambda: metric(cluster.router_m, "tandem_router_indexed_blocks") == 0)
    assert cluster.resets() == before + 1
    assert cluster.cached_tokens(SHORT) == 0  # cold again
    assert cluster.cached_tokens(SHORT) > 0  # and caching as before


def test_aiperf_with_cache_reset_and_cancellations(cluster: Cluster, tokenizer_dir: Path,
                                                   tmp_path: Path) -> None:
    tool("aiperf")  # skips before the cluster work when it is missing
    cluster.cached_tokens(SHORT)
    assert cluster.cached_tokens(SHORT) > 0
    before = cluster.resets()
    res = aiperf_profile(cluster, tokenizer_dir, tmp_path, "chat", concurrency=4, count=16,
                         isl=96, osl=24, seed=3, extra=[
                             "--per-chunk-usage", "--reset-kv-cache",
                             "--request-cancellation-rate", "25",
                             "--request-cancellation-delay", "0.3"])
    done, failed = res["request_count"]["avg"], res.get("error_request_count", {}).get("avg", 0)
    assert done + failed == 16 and done >= 4
    # the only errors are the requests aiperf cancelled itself
    assert {e["error_details"]["type"] for e in res.get("error_summary", [])} <= {"RequestCancellationError"}
    osl = res["output_sequence_length"]
    assert osl["min"] == osl["max"] == 24  # ignore_eos honoured: every answer ran to max_tokens
    assert res["time_to_first_token"]["min"] > 0 and res["inter_token_latency"]["avg"] > 0
    assert cluster.resets() == before + 1  # --reset-kv-cache reached every worker ...
    assert cluster.cached_tokens(SHORT) == 0  # ... and emptied the cache before the run
    until(cluster.idle)  # the cancelled requests left no block and no request behind


def test_guidellm_concurrent_and_completions(cluster: Cluster, tokenizer_dir: Path,
                                             tmp_path: Path) -> None:
    """guidellm's chat and completions requests (it always sends vLLM's
    stream_options.continuous_usage_stats: every chunk carries the usage so far)."""
    guidellm = tool("guidellm")

    def ok_200() -> float:
        return metric(cluster.base + "/metrics", 'tandem_frontend_requests_total{status="200"}')

    before = ok_200()
    for fmt in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):
        out = tmp_path / f"{fmt.rsplit('/', 1)[1]}.json"
        run_tool([str(guidellm), "run", "--backend",
                  f"kind=openai_http,target={cluster.base},model={MODEL},request_format={fmt}",
                  "--tokenizer", f"kind=huggingface_auto,model={tokenizer_dir}",
                  "--profile", "kind=concurrent,streams=4", "--constraint", "kind=max_requests,count=8",
                  "--data", "kind=synthetic_text,prompt_tokens=96,output_tokens=16",
                  "--output", f"kind=json,path={out}", "--disable-console-interactive"], tmp_path)
        (bench,) = json.loads(out.read_text())["benchmarks"]
        m = bench["metrics"]
        assert m["request_totals"] == {"successful": 8, "errored": 0, "incomplete": 0, "total": 8}, fmt
        tokens = m["output_token_count"]["successful"]
        assert tokens["min"] == tokens["max"] == 16, fmt  # its ignore_eos honoured
        assert m["time_to_first_token_ms"]["successful"]["min"] > 0, fmt
    assert ok_200() - before == 24  # the requests the tool counted are the ones we served
    until(cluster.idle)


def test_aiperf_on_the_responses_api(cluster: Cluster, tokenizer_dir: Path, tmp_path: Path) -> None:
    """aiperf's ``--endpoint-type responses``: it reads the token counts from the stream's
    ``response.completed`` event, which ends an answer cut by its token limit too."""
    res = aiperf_profile(cluster, tokenizer_dir, tmp_path, "responses", concurrency=2, count=6,
                         isl=64, osl=16, seed=5)
    assert res["request_count"]["avg"] == 6 and not res.get("error_summary")
    osl = res["output_sequence_length"]
    assert osl["min"] == osl["max"] == 16  # the server's count, from response.completed
    assert res["inter_token_latency"]["avg"] > 0
    until(cluster.idle)
