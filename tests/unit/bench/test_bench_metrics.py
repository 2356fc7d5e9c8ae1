"""Serving metrics against hand-computed values."""

from __future__ import annotations

import pytest

from services.bench.client import RequestRecord
from services.bench.metrics import parse_slos, summarize


def rec(i: int, send: float, chunks: list[float], end: float, completion: int | None = None,
        prompt: int = 100, cached: int | None = None) -> RequestRecord:
    return RequestRecord(i, prompt, send_time=send, first_token_time=chunks[0],
                         chunk_times=chunks, end_time=end, ok=True, prompt_tokens=prompt,
                         completion_tokens=completion, cached_tokens=cached)


def test_summary_by_hand() -> None:
    a = rec(0, 0.0, [0.1, 0.2, 0.4], 0.4, completion=3, cached=50)   # ttft 100, tpot 150, itl 100 200
    b = rec(1, 1.0, [1.3, 1.35], 1.45, completion=4, cached=0)      # ttft 300, tpot 50, itl 50
    c = rec(2, 2.0, [2.2], 2.2, completion=1)                       # ttft 200, no tpot, no itl
    bad = RequestRecord(3, 100, send_time=3.0, error="HTTP 503: busy")
    s = summarize([a, b, c, bad], duration_s=4.0, slos={"ttft_ms": 250, "tpot_ms": 100})
    assert (s.completed, s.failed, s.errors) == (3, 1, {"HTTP 503": 1})
    assert s.ttft.mean == pytest.approx(200.0) and s.ttft.p50 == pytest.approx(200.0)
    assert s.ttft.p90 == pytest.approx(280.0)  # linear: 200 + 0.8 * (300 - 200)
    assert s.tpot.mean == pytest.approx(100.0) and s.tpot.count == 2
    assert s.itl.count == 3 and s.itl.mean == pytest.approx(350 / 3)
    assert s.e2e.mean == pytest.approx((400 + 450 + 200) / 3)
    assert s.request_throughput == pytest.approx(0.75)
    assert s.total_output_tokens == 8 and s.output_throughput == pytest.approx(2.0)
    # a: tpot 150 > 100 fails; b: ttft 300 > 250 fails; c: ttft 200 ok, no tpot -> good
    assert s.goodput == pytest.approx(0.25)
    assert s.prefix_hit_rate == pytest.approx(50 / 200)  # c reported no cached tokens


def test_no_slo_no_goodput_and_empty_run() -> None:
    s = summarize([RequestRecord(0, 10, error="ConnectError: refused")], duration_s=1.0)
    assert s.goodput is None and s.completed == 0 and s.ttft.count == 0
    assert s.errors == {"ConnectError": 1}


def test_parse_slos() -> None:
    assert parse_slos(["ttft_ms=500", "tpot_ms=100"]) == {"ttft_ms": 500.0, "tpot_ms": 100.0}
    for bad in ("ttft=5", "ttft_ms", "ttft_ms=x", "ttft_ms=0"):
        with pytest.raises(ValueError, match="--slo"):
            parse_slos([bad])
