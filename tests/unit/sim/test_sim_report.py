"""The simulator's JSON summary, per-request JSONL, table and progress bar, from SimResults
built by hand."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest

from services.sim.progress import Progress
from services.sim.records import GapSamples
from services.sim.report import format_table, summary, weighted_percentiles, write_requests
from tests.support.sim_results import record, result

KEYS = {"requests", "completed", "failed", "ttft_ms", "itl_ms", "e2e_ms", "tpot_ms",
        "prefix_hit_rate", "oracle_hit_rate", "goodput_rps", "throughput_rps", "output_tok_s",
        "remote_prefill_fraction", "per_worker", "duration_s", "wall_s", "steps",
        "fast_forward_steps"}
DIST = {"mean", "p50", "p90", "p99"}
QS = (0, 1, 10, 25, 33.3, 50, 66.7, 90, 95, 99, 99.9, 100)


def _np_dist(values: np.ndarray) -> dict[str, float]:
    return {"mean": round(float(values.mean()), 3),
            **{f"p{q}": round(float(np.percentile(values, q)), 3) for q in (50, 90, 99)}}


def test_every_key_is_there_and_the_summary_is_json() -> None:
    s = summary(result([record(i, sent=i * 0.5) for i in range(4)]))
    assert set(s) == KEYS
    for k in ("ttft_ms", "itl_ms", "e2e_ms", "tpot_ms"):
        assert set(s[k]) == DIST
    assert set(s["per_worker"]) == {"decode-0", "decode-1", "prefill-0"}
    for w in s["per_worker"].values():
        assert set(w) == {"role", "requests", "hit_rate", "peak_kv_use", "busy_fraction"}
    assert json.loads(json.dumps(s)) == s


@pytest.mark.parametrize("seed", range(12))
def test_weighted_percentiles_equal_numpy_on_the_expansion_bit_for_bit(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 60))
    # Few distinct values (ties across entries), counts from 0 up, one entry very heavy.
    values = rng.choice(rng.random(max(1, n // 2)) * 0.1, size=n)
    counts = rng.integers(0, 9, size=n)
    counts[rng.integers(0, n)] += int(rng.integers(1, 500))
    expanded = np.repeat(values, counts)
    got = weighted_percentiles(values, counts, QS)
    assert got == [float(np.percentile(expanded, q)) for q in QS]


def test_weighted_percentiles_of_one_sample_and_of_none() -> None:
    assert weighted_percentiles(np.array([0.5, 0.7]), np.array([0, 1]), (0, 50, 100)) == [0.7] * 3
    with pytest.raises(ValueError, match="no samples"):
        weighted_percentiles(np.array([0.5]), np.array([0]))


def test_itl_is_the_pooled_gaps_weighted_by_their_counts() -> None:
    rng = np.random.default_rng(7)
    values = list(rng.random(300) * 0.05)
    counts = [int(c) for c in rng.integers(1, 64, size=300)]
    s = summary(result([record(0)], gaps=GapSamples(values, counts)))
    assert s["itl_ms"] == _np_dist(np.repeat(np.array(values) * 1000.0, counts))


def test_ttft_e2e_and_tpot_are_numpys_over_completed_requests() -> None:
    rng = np.random.default_rng(3)
    recs = [record(i, sent=float(i), ttft=float(rng.random()), tokens=1 if i % 7 == 0 else int(rng.integers(2, 40)),
                   tpot=float(rng.random() * 0.1)) for i in range(50)]
    recs.append(record(50, ttft=99.0, completed=False))
    s = summary(result(recs))
    done = recs[:50]
    assert s["requests"] == 51 and s["completed"] == 50 and s["failed"] == 1
    assert s["ttft_ms"] == _np_dist(np.array([r.ttft_s * 1000 for r in done]))
    assert s["e2e_ms"] == _np_dist(np.array([r.e2e_s * 1000 for r in done]))
    tpots = np.array([r.tpot_s * 1000 for r in done if r.tpot_s is not None])
    assert 0 < len(tpots) < 50  # single-token answers have none
    assert s["tpot_ms"] == _np_dist(tpots)


def test_an_empty_run_reports_zeros() -> None:
    s = summary(result([], gaps=GapSamples(), duration=0.0))
    assert s["requests"] == s["completed"] == s["failed"] == 0
    for k in ("ttft_ms", "itl_ms", "e2e_ms", "tpot_ms"):
        assert s[k] == {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    assert s["goodput_rps"] == s["throughput_rps"] == s["output_tok_s"] == 0.0
    assert s["prefix_hit_rate"] == s["remote_prefill_fraction"] == 0.0
    assert s["per_worker"]["decode-0"]["busy_fraction"] == 0.0


def test_goodput_counts_completed_requests_meeting_every_slo() -> None:
    slo = {"ttft_ms": 500.0, "tpot_ms": 50.0, "itl_ms": 80.0, "e2e_ms": 2000.0}
    recs = [
        record(0, ttft=0.4, tokens=10, tpot=0.04, max_gap=0.07),  # meets all
        record(1, ttft=0.6, tokens=10, tpot=0.04),  # TTFT
        record(2, ttft=0.1, tokens=10, tpot=0.06),  # TPOT
        record(3, ttft=0.1, tokens=10, tpot=0.04, max_gap=0.09),  # one gap over ITL
        record(4, ttft=0.4, tokens=40, tpot=0.045),  # E2E 0.4 + 39 * 0.045 = 2.155 s
        record(5, ttft=0.4, tokens=1, tpot=9.0),  # one token: no TPOT nor gap to check
        record(6, ttft=0.5, tokens=2, tpot=0.03125),  # TTFT at its target: meets
        record(7, ttft=0.1, completed=False),  # failed: never good
    ]
    s = summary(result(recs, slo=slo, duration=4.0))
    assert s["goodput_rps"] == 3 / 4.0
    assert s["throughput_rps"] == 7 / 4.0
    assert s["output_tok_s"] == round((10 * 4 + 40 + 1 + 2) / 4.0, 4)
    # Without an SLO every completed request is good.
    assert summary(result(recs, slo={}, duration=4.0))["goodput_rps"] == 7 / 4.0


def test_hit_rates_remote_fraction_and_per_worker() -> None:
    recs = [record(0, prompt=100, cached=50, remote=True), record(1, prompt=300, cached=0),
            record(2, prompt=1000, cached=1000, completed=False)]
    s = summary(result(recs, duration=10.0))
    assert s["prefix_hit_rate"] == 0.125  # 50 / 400: completed requests only
    assert s["remote_prefill_fraction"] == 0.5
    assert s["oracle_hit_rate"] == 0.6123
    assert s["per_worker"]["decode-1"] == {"role": "decode", "requests": 4, "hit_rate": 0.25,
                                           "peak_kv_use": 0.5156, "busy_fraction": 0.5}
    assert s["per_worker"]["prefill-0"]["hit_rate"] == 0.0  # no prompt tokens: no rate
    assert (s["duration_s"], s["wall_s"], s["steps"], s["fast_forward_steps"]) == (
        10.0, 1.235, 100, 900)


def test_write_requests_one_line_per_request_with_latencies(tmp_path: Path) -> None:
    recs = [record(0, sent=1.0, ttft=0.25, tokens=3, tpot=0.5), record(1, tokens=1),
            record(2, completed=False)]
    path = write_requests(result(recs), tmp_path / "out" / "requests.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2]
    assert set(rows[0]) >= {"sent_s", "prompt_tokens", "output_tokens", "worker",
                            "prefill_worker", "remote", "cached_tokens", "first_token_s",
                            "end_s", "tokens_out", "last_token_s", "max_gap_s", "completed",
                            "error", "ttft_ms", "tpot_ms", "e2e_ms"}
    assert (rows[0]["ttft_ms"], rows[0]["tpot_ms"], rows[0]["e2e_ms"]) == (250.0, 500.0, 1250.0)
    assert rows[1]["tpot_ms"] is None
    assert rows[2]["ttft_ms"] is None and rows[2]["error"] == "refused"


def test_format_table_aligns_columns_under_the_header() -> None:
    text = format_table([{"decode.replicas": "8", "ttft_mean_ms": 12.3456, "n": 3},
                         {"decode.replicas": "64", "ttft_mean_ms": 1234.5, "n": 10}])
    lines = text.splitlines()
    assert lines[0].split() == ["decode.replicas", "ttft_mean_ms", "n"]
    assert lines[1].split() == ["8", "12.346", "3"]
    assert lines[2].split() == ["64", "1234.500", "10"]
    assert len({len(line) for line in lines}) == 1
    assert format_table([]) == ""


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_draws_on_a_terminal_only() -> None:
    pipe = io.StringIO()
    with Progress(10, pipe) as p:
        p(1.5, 3)
        p(9.0, 10)
    assert pipe.getvalue() == ""
    term = _Terminal()
    with Progress(10, term) as p:
        p(1.5, 3)
        p(9.0, 10)
    drawn = term.getvalue()
    assert "10/10" in drawn and "virtual 9.0 s" in drawn
