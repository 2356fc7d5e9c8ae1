"""services/sim/traces.py: trace formats, bench workloads, selection, prompt tokens and
the infinite-cache oracle, on small traces written here."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from services.bench import workloads
from services.bench.args import add_workload_args
from services.bench.arrivals import ArrivalSpec, schedule
from services.bench.workloads import ID_HIGH, ID_LOW
from services.sim.requests import SimRequest
from services.sim.traces import (
    PromptMaker,
    bench_workload,
    from_bench,
    load_trace,
    oracle_hit_rate,
    select,
)


def _write_jsonl(path: Path, rows: list[dict | str]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _row(ts: float, n_in: int, n_out: int, ids: list[int]) -> dict:
    return {"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": ids}


AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


# ---- loading -------------------------------------------------------------------------
def test_mooncake_rows_become_requests_in_file_order(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "t.jsonl", [
        _row(0, 1000, 10, [0, 1]), "", _row(1500, 600, 3, [0, 2]), _row(2500, 20, 1, [])])
    reqs = load_trace(path)
    assert reqs == [
        SimRequest(0, 0.0, 1000, 10, (0, 1), 512),
        SimRequest(1, 1.5, 600, 3, (0, 2), 512),
        SimRequest(2, 2.5, 20, 1, None, 512),
    ]


def test_azure_rows_arrive_in_seconds_from_the_first_row(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text(AZURE_HEADER + "2023-11-16 18:15:46.6805900,374,44\n"
                    "2023-11-16 18:15:50.9951690,396,109\n2023-11-16 18:16:46.6805900,5,1\n")
    reqs = load_trace(path)
    assert [(r.index, r.input_len, r.output_len) for r in reqs] == [(0, 374, 44), (1, 396, 109), (2, 5, 1)]
    assert [r.arrival_s for r in reqs] == pytest.approx([0.0, 4.314579, 60.0])
    assert all(r.hash_ids is None and r.prompt is None and r.after is None for r in reqs)


def test_auto_reads_the_content_then_the_suffix(tmp_path: Path) -> None:
    moon = _write_jsonl(tmp_path / "trace.txt", [_row(0, 10, 1, [7])])
    assert load_trace(moon)[0].hash_ids == (7,)
    azure = tmp_path / "trace.data"
    azure.write_text(AZURE_HEADER + "2023-11-16 18:15:46.6805900,374,44\n")
    assert load_trace(azure)[0].input_len == 374
    (tmp_path / "empty.csv").write_text("")
    assert load_trace(tmp_path / "empty.csv") == []
    other = tmp_path / "other.jsonl"
    other.write_text("a,b,c\n1,2,3\n")
    with pytest.raises(ValueError, match="not a Mooncake JSONL or Azure CSV"):
        load_trace(other)
    with pytest.raises(ValueError, match="unknown format"):
        load_trace(moon, fmt="sharegpt")  # type: ignore[arg-type]


@pytest.mark.parametrize("bad, why", [
    ("{not json", "Expecting"),
    (json.dumps({"timestamp": 0, "input_length": 5, "output_length": 1}), "no field 'hash_ids'"),
    (json.dumps(_row(0, 5, 0, [1])), "output_length must be an integer >= 1"),
    (json.dumps(_row(0, 5.5, 1, [1])), "input_length must be an integer >= 1"),
    (json.dumps(_row(0, 5, 1, [1, -2])), "hash_ids must be a list of ints >= 0"),
    (json.dumps(_row(0, 5, 1, [1, 2.0])), "hash_ids must be a list of ints >= 0"),
    (json.dumps(_row("0", 5, 1, [1])), "timestamp must be a number"),
    ("[1, 2]", "list indices"),
])
def test_a_bad_mooncake_row_is_named_by_file_and_line(tmp_path: Path, bad: str, why: str) -> None:
    path = _write_jsonl(tmp_path / "t.jsonl", [_row(0, 10, 1, [1]), "", bad])
    with pytest.raises(ValueError, match=rf"t\.jsonl:3: not a Mooncake trace row \(.*{why}"):
        load_trace(path, fmt="mooncake")


@pytest.mark.parametrize("bad, why", [
    ("2023-11-16 18:15:47.0,abc,3", "invalid literal"),
    ("2023-11-16 18:15:47.0,12,0", "GeneratedTokens must be an integer >= 1"),
    ("yesterday,12,3", "Invalid isoformat"),
    ("2023-11-16 18:15:47.0,12", "ContextTokens|GeneratedTokens"),
    ("2023-11-16 18:15:45.0,12,3", "earlier than the first row"),
])
def test_a_bad_azure_row_is_named_by_file_and_line(tmp_path: Path, bad: str, why: str) -> None:
    path = tmp_path / "t.csv"
    path.write_text(AZURE_HEADER + "2023-11-16 18:15:46.6805900,374,44\n" + bad + "\n")
    with pytest.raises(ValueError, match=rf"t\.csv:3: not an Azure trace row \(.*({why})"):
        load_trace(path)


def test_an_azure_file_without_its_columns_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("TIMESTAMP,ContextTokens\n2023-11-16 18:15:46.6805900,374\n")
    with pytest.raises(ValueError, match=r"t\.csv:1: not an Azure trace header \(no GeneratedTokens\)"):
        load_trace(path, fmt="azure")


# ---- bench workloads -----------------------------------------------------------------
def test_from_bench_keeps_prompts_and_turn_order_at_the_schedules_send_times() -> None:
    reqs = workloads.multi_turn(3, 2, 8, 4, 4, 5, seed=1)
    send = schedule(ArrivalSpec("poisson", rate=2.0, seed=3), len(reqs))
    sim = from_bench(reqs, send)
    assert [(s.index, s.arrival_s, s.prompt, s.input_len, s.output_len, s.after) for s in sim] == [
        (r.index, t, r.prompt_ids, r.prompt_len, r.output_len, r.after) for r, t in zip(reqs, send, strict=True)]
    assert any(s.after is not None for s in sim)
    assert len(from_bench(reqs, send[:4])) == 4  # a schedule cut by its duration
    with pytest.raises(ValueError, match="7 send times for 6 requests"):
        from_bench(reqs, [*send, 9.0])


def _bench_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_workload_args(p)
    return p.parse_args(list(argv))


def test_bench_workload_is_what_bench_serve_sends() -> None:
    args = _bench_args("--workload", "shared-prefix", "--num-requests", "10", "--groups", "2",
                       "--arrival", "gamma", "--rate", "3", "--burstiness", "0.5", "--seed", "4",
                       "--duration", "2.0")
    reqs = workloads.shared_prefix(2, 5, 256, 32, 16, seed=4)
    send = schedule(ArrivalSpec("gamma", rate=3.0, burstiness=0.5, seed=4), 10, 2.0)
    assert 0 < len(send) < 10
    assert bench_workload(args) == from_bench(reqs, send)


def test_bench_workload_refuses_concurrency_arrivals() -> None:
    with pytest.raises(ValueError, match="concurrency is not supported"):
        bench_workload(_bench_args("--arrival", "concurrency", "--num-requests", "4"))


# ---- selection -----------------------------------------------------------------------
def _req(i: int, t: float, ids: tuple[int, ...] | None = None, after: int | None = None) -> SimRequest:
    return SimRequest(i, t, 100, 5, ids, after=after)


def test_select_keeps_a_half_open_window_rebased_to_its_start() -> None:
    reqs = [_req(i, t) for i, t in enumerate([0.0, 10.0, 20.0, 30.0, 40.0])]
    out = select(reqs, start_s=10.0, end_s=30.0)
    assert [(r.index, r.arrival_s) for r in out] == [(0, 0.0), (1, 10.0)]
    assert [r.arrival_s for r in select(reqs, end_s=20.0)] == [0.0, 10.0]
    assert [r.arrival_s for r in select(reqs, start_s=35.0)] == [5.0]


def test_select_samples_whole_conversations_by_their_second_hash_id() -> None:
    ids = [(0, 4, 9), (0, 3), (0, 4, 9, 10), (5,), None, (1, 8), (2, 6, 1)]
    reqs = [_req(i, float(i), h) for i, h in enumerate(ids)]
    out = select(reqs, sample_mod=4)
    # Dynamo's --sample-mod rule, on the rows themselves
    expected = [h for h in ids if h is not None and len(h) >= 2 and h[1] % 4 == 0]
    assert [r.hash_ids for r in out] == expected == [(0, 4, 9), (0, 4, 9, 10), (1, 8)]
    assert [r.index for r in out] == [0, 1, 2]
    assert [r.arrival_s for r in out] == [0.0, 2.0, 5.0]  # sampled times stay as they were


def test_select_divides_arrivals_by_the_speedup_after_the_window() -> None:
    reqs = [_req(i, t) for i, t in enumerate([0.0, 10.0, 20.0, 30.0])]
    out = select(reqs, start_s=10.0, speedup=4.0)
    assert [r.arrival_s for r in out] == [0.0, 2.5, 5.0]


def test_select_limit_keeps_the_first_arrivals_and_remaps_after() -> None:
    # index order is not arrival order here: 3 arrives first
    reqs = [_req(0, 1.0), _req(1, 2.0, after=0), _req(2, 5.0, after=1), _req(3, 0.5),
            _req(4, 3.0, after=3), _req(5, 4.0, after=2)]
    out = select(reqs, limit=5)
    assert [(r.arrival_s, r.after) for r in out] == [(0.5, None), (1.0, None), (2.0, 1), (3.0, 0), (4.0, None)]
    assert [r.index for r in out] == list(range(5))
    cut = select(reqs, start_s=1.5)  # 0 and 3 are cut: 1 and 4 no longer wait
    assert [(r.arrival_s, r.after) for r in cut] == [(0.5, None), (1.5, None), (2.5, 3), (3.5, 0)]


@pytest.mark.parametrize("kwargs, why", [
    ({"speedup": 0.0}, "speedup must be > 0"),
    ({"sample_mod": 0}, "sample_mod must be >= 1"),
    ({"limit": -1}, "limit must be >= 0"),
    ({"start_s": 5.0, "end_s": 5.0}, "must be after start_s"),
])
def test_select_refuses_bad_arguments(kwargs: dict, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        select([_req(0, 0.0)], **kwargs)


# ---- prompt tokens -------------------------------------------------------------------
def _trace_req(i: int, ids: tuple[int, ...] | None, n: int, block: int = 512) -> SimRequest:
    return SimRequest(i, float(i), n, 1, ids, block)


def _common(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n


def test_prompt_maker_is_deterministic_and_in_the_id_range() -> None:
    req = _trace_req(3, (4, 8, 15), 1300)
    toks = PromptMaker(seed=1).tokens(req)
    assert len(toks) == 1300 and all(type(t) is int for t in toks)
    assert ID_LOW <= min(toks) and max(toks) < ID_HIGH
    assert len(set(toks)) > 1000  # not a constant fill
    assert PromptMaker(seed=1).tokens(req) == toks
    assert _common(PromptMaker(seed=2).tokens(req), toks) < 16


def test_a_request_with_a_prompt_gets_it() -> None:
    req = SimRequest(0, 0.0, 3, 1, (1, 2), prompt=(1001, 1002, 1003))
    assert PromptMaker().tokens(req) == [1001, 1002, 1003]


def test_same_id_same_tokens_wherever_it_sits() -> None:
    pm = PromptMaker()
    a = pm.tokens(_trace_req(0, (5, 7), 1024))
    b = pm.tokens(_trace_req(9, (7, 5, 1), 1500))
    assert a[512:1024] == b[:512] and a[:512] == b[512:1024]


@pytest.mark.parametrize("block", [512, 64])
def test_token_prefixes_are_equal_exactly_as_far_as_the_id_prefixes(block: int) -> None:
    rng = np.random.default_rng(0)
    pm = PromptMaker()
    reqs = []
    for i in range(40):  # chains that share prefixes of every length with one another
        base = reqs[int(rng.integers(len(reqs)))].hash_ids if reqs and rng.random() < 0.8 else ()
        keep = int(rng.integers(len(base) + 1))
        ids = base[:keep] + tuple(int(x) for x in rng.integers(0, 60, size=int(rng.integers(1, 5))))
        reqs.append(_trace_req(i, ids, len(ids) * block - int(rng.integers(block // 2)), block))
    toks = [pm.tokens(r) for r in reqs]
    for a in range(len(reqs)):
        for b in range(a + 1, len(reqs)):
            ia, ib = reqs[a].hash_ids, reqs[b].hash_ids
            same = next((k for k, (x, y) in enumerate(zip(ia, ib, strict=False)) if x != y), min(len(ia), len(ib)))
            lcp = _common(toks[a], toks[b])
            shorter = min(len(toks[a]), len(toks[b]))
            if same * block >= shorter:
                assert lcp == shorter
            else:  # they part within the first tokens of the first block that differs
                assert same * block <= lcp < same * block + 8


def test_what_the_ids_do_not_cover_is_unique_to_the_request() -> None:
    pm = PromptMaker()
    a, b = pm.tokens(_trace_req(0, (1,), 1200)), pm.tokens(_trace_req(1, (1,), 1200))
    assert a[:512] == b[:512] and _common(a, b) < 520
    assert pm.tokens(_trace_req(0, (1,), 1200)) == a  # keyed by the index, not by chance
    c, d = pm.tokens(_trace_req(0, None, 700)), pm.tokens(_trace_req(1, None, 700))
    assert len(c) == 700 and _common(c, d) < 8 and _common(c, a) < 8
    assert PromptMaker().tokens(_trace_req(1, None, 700)) == d


# ---- the infinite-cache oracle -------------------------------------------------------
def test_oracle_on_id_chains_caps_a_hit_below_the_whole_prompt() -> None:
    # block 4, trace block 8: two engine blocks per id
    reqs = [_trace_req(0, (1, 2), 16, 8), _trace_req(1, (1, 2), 16, 8)]
    # the second prompt is all cached, but its hit stops at (16 - 1) // 4 = 3 blocks
    assert oracle_hit_rate(reqs, 4) == pytest.approx(12 / 32)
    # one block fewer cached than it has: the cap does not bind, 3 blocks hit
    reqs = [_trace_req(0, (1, 2, 3), 14, 8), _trace_req(1, (1, 2, 9), 17, 8)]
    assert oracle_hit_rate(reqs, 4) == pytest.approx(12 / 31)


def test_oracle_counts_a_partial_last_block_as_far_as_an_earlier_prompt_went() -> None:
    reqs = [_trace_req(0, (1, 2), 12, 8),  # caches id 2's first engine block only
            _trace_req(1, (1, 2), 17, 8),  # hits 2 + 1 blocks, caches id 2's second block
            _trace_req(2, (1, 2), 20, 8),  # hits 4 blocks: all of its full blocks
            _trace_req(3, (1, 3), 20, 8)]  # hits id 1's 2 blocks
    assert oracle_hit_rate(reqs, 4) == pytest.approx((0 + 12 + 16 + 8) / (12 + 17 + 20 + 20))


def test_oracle_goes_by_arrival_not_by_index() -> None:
    first = SimRequest(0, 5.0, 16, 1, (1, 2), 8)
    second = SimRequest(1, 1.0, 10, 1, (1,), 8)  # arrives first: caches id 1's 2 blocks
    assert oracle_hit_rate([first, second], 4) == pytest.approx(8 / 26)


def test_oracle_on_tokens_where_engine_blocks_straddle_trace_blocks() -> None:
    # trace block 24, engine block 16: matched on the maker's tokens
    reqs = [_trace_req(0, (1, 2), 48, 24), _trace_req(1, (1, 2), 48, 24),
            _trace_req(2, (1, 5), 48, 24)]
    # second: 3 full blocks cached, cap (48 - 1) // 16 = 2; third: block 0 whole in id 1,
    # block 1 straddles ids 1 and 5, so 1 block
    assert oracle_hit_rate(reqs, 16) == pytest.approx((32 + 16) / 144)


def test_oracle_on_id_chains_is_the_oracle_on_the_makers_tokens() -> None:
    rng = np.random.default_rng(5)
    reqs: list[SimRequest] = []
    for i in range(80):
        base = reqs[int(rng.integers(len(reqs)))].hash_ids if reqs and rng.random() < 0.7 else ()
        ids = base[: int(rng.integers(len(base) + 1))] + tuple(int(x) for x in rng.integers(0, 40, size=3))
        n = int(rng.integers(1, len(ids) * 64 + 40))  # some ids cover less than the prompt
        reqs.append(SimRequest(i, float(rng.random()), n, 1, ids, 64))
    pm = PromptMaker(seed=3)
    as_tokens = [replace(r, hash_ids=None, prompt=tuple(pm.tokens(r))) for r in reqs]
    for bs in (16, 32, 64):
        rate = oracle_hit_rate(reqs, bs)
        assert rate > 0.1
        assert rate == oracle_hit_rate(as_tokens, bs)


def test_oracle_agrees_with_the_bench_oracle_where_the_cap_does_not_bind() -> None:
    wl = workloads.shared_prefix(3, 4, 40, 10, 1, seed=2) + workloads.multi_turn(2, 3, 20, 9, 7, 1, seed=2)
    wl = [replace(r, index=i) for i, r in enumerate(wl)]
    assert all(r.prompt_len % 16 for r in wl)  # a partial last block: the cap cannot bind
    sim = from_bench(wl, [float(i) for i in range(len(wl))])
    bench = workloads.oracle_hit_rate([r.prompt_ids for r in wl], 16)
    assert bench > 0.3
    assert oracle_hit_rate(sim, 16) == pytest.approx(bench)


def test_oracle_differs_from_the_bench_oracle_by_the_cap_alone() -> None:
    wl = workloads.shared_prefix(1, 3, 32, 16, 1, seed=0)  # 48 tokens: 3 full blocks of 16
    repeat = [*wl, replace(wl[0], index=3)]  # a prompt sent again: all of it cached
    sim = from_bench(repeat, [0.0, 1.0, 2.0, 3.0])
    bench = workloads.oracle_hit_rate([r.prompt_ids for r in repeat], 16)
    assert bench == pytest.approx((0 + 32 + 32 + 48) / 192)
    assert oracle_hit_rate(sim, 16) == pytest.approx((0 + 32 + 32 + 32) / 192)


def test_oracle_without_ids_or_prompts_hits_nothing() -> None:
    reqs = [_trace_req(0, None, 100), _trace_req(1, None, 100)]
    assert oracle_hit_rate(reqs, 16) == 0.0
    assert oracle_hit_rate([], 16) == 0.0
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        oracle_hit_rate(reqs, 0)
