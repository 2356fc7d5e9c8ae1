"""`tandem bench serve` end to end: the CLI streams a small workload through a real stack
(frontend -> processor -> router -> decode on the mock runner) and writes its JSON."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from services.cli import main as tandem
from services.model.tokenizer import Tokenizer
from tests.support.cluster import running_cluster
from tests.support.mock_cluster import MODEL, mock_cluster_cfg


@pytest.fixture(scope="module")
def tok(smollm2_path: Path) -> Tokenizer:
    return Tokenizer.from_path(smollm2_path)


async def test_bench_serve_writes_counts_latencies_and_hits(nats_url: str, tok: Tokenizer,
                                                            tmp_path: Path) -> None:
    cfg = mock_cluster_cfg(namespace="bench1", nats={"url": nats_url})
    out = tmp_path / "res.json"
    async with running_cluster(cfg, tok) as c:
        # 2 groups x 3 prompts sharing a 64-token system prompt, 4 output tokens each, at a
        # fixed concurrency of 2; one SLO loose enough that every request meets it
        rc = await asyncio.to_thread(tandem, [
            "bench", "serve", "--base-url", c.url, "--model", MODEL, "--workload", "shared-prefix",
            "--num-requests", "6", "--groups", "2", "--system-len", "64", "--question-len", "8",
            "--output-len", "4", "--arrival", "concurrency", "--concurrency", "2",
            "--slo", "e2e_ms=600000", "--json", str(out), "--plot", str(tmp_path / "plots")])
    assert rc == 0
    res = json.loads(out.read_text())
    s = res["summary"]
    assert (s["completed"], s["failed"], s["errors"]) == (6, 0, {})
    assert s["total_output_tokens"] == 24 and s["total_input_tokens"] == 6 * 72
    # one ITL per gap between two chunks: 3 a request, fewer where a chunk carried the
    # tokens queued behind a reader that fell behind (AsyncEngine.stream)
    assert s["ttft"]["count"] == 6 and s["tpot"]["count"] == 6 and s["itl"]["count"] <= 18
    assert 0 < s["ttft"]["p50"] <= s["ttft"]["p99"] <= s["e2e"]["p99"]
    assert s["goodput"] == pytest.approx(s["request_throughput"])
    # oracle: 4 of 6 prompts find their group's 4 system blocks (64 tokens) cached
    assert res["oracle_prefix_hit_rate"] == pytest.approx(4 * 64 / (6 * 72))
    # one worker serves all: later prompts of a group hit its cache (as the usage says)
    assert 0 < s["prefix_hit_rate"] <= res["oracle_prefix_hit_rate"] + 1e-9
    assert len(res["requests"]) == 6 and all(r["ok"] and r["output_tokens"] == 4
                                            for r in res["requests"])
    assert len(res["itl_ms"]) == s["itl"]["count"]
    assert res["meta"]["load_average_1m"]["before"] is not None
    assert {p.name for p in (tmp_path / "plots").iterdir()} == {"ttft_cdf.png", "itl_cdf.png"}


async def test_bench_serve_counts_failures(tmp_path: Path) -> None:
    out = tmp_path / "res.json"
    # nothing listens on port 9: every request fails, and the run says so (exit 1)
    rc = await asyncio.to_thread(tandem, [
        "bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", MODEL,
        "--num-requests", "3", "--arrival", "poisson", "--rate", "100", "--json", str(out)])
    s = json.loads(out.read_text())["summary"]
    assert rc == 1 and (s["completed"], s["failed"]) == (0, 3)
    assert s["errors"] == {"ConnectError": 3}


async def test_bench_serve_rate_sweep_sends_fresh_prompts_per_rate(nats_url: str, tok: Tokenizer,
                                                                   tmp_path: Path) -> None:
    cfg = mock_cluster_cfg(namespace="bench2", nats={"url": nats_url})
    out = tmp_path / "sweep.json"
    async with running_cluster(cfg, tok) as c:
        # one 64-token system prompt under 3 questions, at two rates on one server
        rc = await asyncio.to_thread(tandem, [
            "bench", "serve", "--base-url", c.url, "--model", MODEL, "--workload", "shared-prefix",
            "--num-requests", "3", "--groups", "1", "--system-len", "64", "--question-len", "8",
            "--output-len", "4", "--rates", "20,10", "--rate-settle", "0.1",
            "--slo", "ttft_ms=600000", "--slo", "tpot_ms=600000", "--json", str(out),
            "--plot", str(tmp_path / "plots")])
    assert rc == 0
    res = json.loads(out.read_text())
    layout = res["sweep"]["layouts"][MODEL]
    assert [p["rate"] for p in layout["points"]] == [10.0, 20.0]
    assert all(p["attainment"] == 1.0 for p in layout["points"])
    assert layout["goodput_rps"] == 20.0 and res["sweep"]["comparisons"] == []
    first, second = res["rate_runs"][MODEL]
    # the second rate's first request finds nothing the first rate left in the cache: its
    # token ids are shifted (unshifted, it would hit the 64-token system prompt)
    assert second["meta"]["token_id_shift"] == 1
    assert second["requests"][0]["cached_tokens"] == 0
    assert first["oracle_prefix_hit_rate"] == second["oracle_prefix_hit_rate"] > 0
    assert {p.name for p in (tmp_path / "plots").iterdir()} == {"slo_attainment.png"}


async def test_bench_serve_rate_sweep_needs_both_slos(capsys: pytest.CaptureFixture[str]) -> None:
    rc = await asyncio.to_thread(tandem, [
        "bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", MODEL,
        "--rates", "1,2", "--slo", "ttft_ms=1000"])
    assert rc == 2 and "--slo tpot_ms=MS" in capsys.readouterr().err
