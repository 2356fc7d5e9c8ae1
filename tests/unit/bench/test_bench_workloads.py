"""Benchmark workloads: deterministic prefixes, scaling, and the real traces' first rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.bench import workloads as w

TRACES = Path("/work/shared/traces")
MOONCAKE = TRACES / "synthetic_trace.jsonl"
AZURE = TRACES / "AzureLLMInferenceTrace_conv.csv"


def _write_mooncake(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_mooncake_equal_hash_ids_share_exactly_their_prefix(tmp_path: Path) -> None:
    trace = _write_mooncake(tmp_path / "t.jsonl", [
        {"timestamp": 0, "input_length": 1536, "output_length": 64, "hash_ids": [0, 1, 2]},
        {"timestamp": 250, "input_length": 1200, "output_length": 10, "hash_ids": [0, 1, 3]},
        {"timestamp": 500, "input_length": 1024, "output_length": 10, "hash_ids": [4, 1]},
    ])
    a, b, c = w.mooncake(trace, scale=1 / 32)
    # 512-token blocks become 16 tokens; lengths scale the same way
    assert (a.prompt_len, b.prompt_len, c.prompt_len) == (48, 38, 32)
    assert a.output_len == 2 and b.output_len == 1  # 64/32, and never below 1
    assert a.prompt_ids[:32] == b.prompt_ids[:32]  # ids 0, 1 shared
    assert a.prompt_ids[32:38] != b.prompt_ids[32:38]  # id 2 vs id 3
    # the same id at a different position is the same text, but a different first block
    # means no shared prefix
    assert c.prompt_ids[16:32] == a.prompt_ids[16:32] and c.prompt_ids[:16] != a.prompt_ids[:16]
    assert (a.arrival_s, b.arrival_s, c.arrival_s) == (0.0, 0.25, 0.5)
    # deterministic across parses; a different seed gives different text
    assert w.mooncake(trace, scale=1 / 32)[0] == a
    assert w.mooncake(trace, scale=1 / 32, seed=1)[0].prompt_ids != a.prompt_ids
    assert all(w.ID_LOW <= t < w.ID_HIGH for t in a.prompt_ids)


def test_mooncake_bad_rows_and_scale_are_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        w.mooncake(bad)
    with pytest.raises(ValueError, match="scale"):
        w.mooncake(bad, scale=0)


def test_oracle_hit_rate_counts_leading_blocks_seen_before() -> None:
    p1 = list(range(1000, 1048))  # 3 blocks of 16
    p2 = p1[:32] + list(range(2000, 2016))  # shares 2 blocks
    p3 = list(range(3000, 3010))  # no full block
    assert w.oracle_hit_rate([p1, p2, p3], 16) == pytest.approx(32 / (48 + 48 + 10))
    assert w.oracle_hit_rate([p1, p1], 16) == pytest.approx(0.5)
    assert w.oracle_hit_rate([], 16) == 0.0


def test_shared_prefix_groups_share_system_prompts() -> None:
    reqs = w.shared_prefix(num_groups=3, prompts_per_group=4, system_len=32, question_len=8,
                           output_len=5, seed=3)
    assert len(reqs) == 12 and all(r.prompt_len == 40 and r.output_len == 5 for r in reqs)
    systems = {r.prompt_ids[:32] for r in reqs}
    assert len(systems) == 3
    assert len({r.prompt_ids for r in reqs}) == 12
    # 3 first-seen prompts miss entirely; the other 9 hit their 2 system blocks
    assert w.oracle_hit_rate([r.prompt_ids for r in reqs], 16) == pytest.approx(9 * 32 / (12 * 40))
    assert w.shared_prefix(3, 4, 32, 8, 5, seed=3) == reqs
    with pytest.raises(ValueError, match="num_groups"):
        w.shared_prefix(0, 4, 32, 8, 5)


def test_multi_turn_resends_history_and_chains_turns() -> None:
    reqs = w.multi_turn(num_conversations=2, turns=3, system_len=16, user_len=8,
                        assistant_len=4, output_len=4)
    assert len(reqs) == 6
    c0 = [r for r in reqs if r.index % 2 == 0]
    assert [r.after for r in c0] == [None, 0, 2]
    for prev, nxt in zip(c0, c0[1:], strict=False):
        assert nxt.prompt_ids[:prev.prompt_len] == prev.prompt_ids
        assert nxt.prompt_len == prev.prompt_len + 4 + 8


def test_mixed_lengths_shares() -> None:
    reqs = w.mixed_lengths(400, short_len=8, long_len=64, long_fraction=0.25, output_len=3)
    longs = sum(r.prompt_len == 64 for r in reqs)
    assert 70 < longs < 130 and all(r.prompt_len in (8, 64) for r in reqs)


def test_render_text_keeps_prefixes() -> None:
    a, b = (1000, 1001, 1002), (1000, 1001, 1500)
    assert w.render_text(b).startswith(w.render_text(a[:2]))
    assert w.render_text(a) != w.render_text(b)


@pytest.mark.skipif(not MOONCAKE.exists(), reason="shared traces not on this machine")
def test_real_mooncake_first_rows() -> None:
    rows = [json.loads(line) for line in MOONCAKE.open().readlines()[:20]]
    reqs = w.mooncake(MOONCAKE, scale=1 / 32, limit=20)
    assert len(reqs) == 20
    for row, r in zip(rows, reqs, strict=True):
        assert r.prompt_len == max(1, round(row["input_length"] / 32))
        assert r.arrival_s == row["timestamp"] / 1000
        assert len(row["hash_ids"]) * 16 >= r.prompt_len
    # rows sharing their first hash id share their first scaled block
    by_first: dict[int, tuple[int, ...]] = {}
    for row, r in zip(rows, reqs, strict=True):
        first = by_first.setdefault(row["hash_ids"][0], r.prompt_ids[:16])
        assert r.prompt_ids[:16] == first


@pytest.mark.skipif(not AZURE.exists(), reason="shared traces not on this machine")
def test_real_azure_first_rows() -> None:
    reqs = w.azure(AZURE, scale=1 / 8, limit=3)
    # 2023-11-16 18:15:46.6805900,374,44 then 18:15:50.9951690,396,109
    assert reqs[0].arrival_s == 0.0
    assert reqs[1].arrival_s == pytest.approx(50.995169 - 46.68059, abs=1e-6)
    assert (reqs[0].prompt_len, reqs[0].output_len) == (round(374 / 8), round(44 / 8))
    assert (reqs[1].prompt_len, reqs[1].output_len) == (round(396 / 8), round(109 / 8))
