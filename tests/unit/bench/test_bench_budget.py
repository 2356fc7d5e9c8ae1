"""bench budget on the mock runner: every point of the sweep reports its figures, and the ITL
target cuts the ITL tail a long prompt puts on running streams."""

from __future__ import annotations

import argparse
from pathlib import Path

from services.bench.args import add_bench_parsers
from services.bench.budget import main


def _args(tmp_path: Path, *extra: str) -> argparse.Namespace:
    root = argparse.ArgumentParser()
    sub = root.add_subparsers(dest="command")

    def add_config(p: argparse.ArgumentParser) -> None:
        p.add_argument("-c", dest="config", default=None)
        p.add_argument("--set", dest="overrides", action="append", default=[])

    add_bench_parsers(sub, add_config)
    return root.parse_args(["bench", "budget", "--budgets", "1024", "--itl-targets", "0,30",
                            "--streams", "2", "--requests", "3", "--rate", "20",
                            "--long-share", "1", "--long-tokens", "1000", "--ref-steps", "3",
                            "--output-tokens", "4", "--json", str(tmp_path / "b.json"),
                            "--set", "engine.runner=mock", "--set", "engine.mock.step_base_s=0.001",
                            "--set", "engine.mock.per_prefill_token_s=0.0001",
                            "--set", "engine.mock.per_decode_seq_s=0.0005", *extra])


def test_a_sweep_reports_each_point_and_the_target_cuts_the_itl_tail(tmp_path: Path) -> None:
    import json

    assert main(_args(tmp_path)) == 0
    res = json.loads((tmp_path / "b.json").read_text())
    off, on = res["points"]
    assert (off["itl_target_ms"], on["itl_target_ms"]) == (0.0, 30.0)
    for p in (off, on):
        assert p["requests"] == 3 == p["long_requests"] and p["itl_samples"] > 0
        assert p["decode_only_step_ms"] > 0 and p["output_tokens_per_s"] > 0
        assert p["decode_only_step_end_ms"] > 0  # timed again once the arrivals finished
        end_ratio = p["itl_ms"]["p99"] / p["decode_only_step_end_ms"]  # of rounded figures
        assert abs(p["itl_p99_over_decode_step_end"] - end_ratio) <= 0.05 * end_ratio
        assert p["itl_ms"]["p50"] <= p["itl_ms"]["p95"] <= p["itl_ms"]["p99"]
        assert p["add_request_ms"]["p50"] is not None and p["ttft_long_ms"]["p50"] is not None
    # 1000 tokens of 0.1 ms: a 100 ms step off; the target holds steps near 30 ms
    assert on["itl_ms"]["max"] < off["itl_ms"]["max"]
    assert res["workload"]["streams"] == 2 and "command" in res
