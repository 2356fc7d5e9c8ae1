"""`tandem sim calibrate`'s figures, comparison and table with canned numbers; its
workloads and the simulator's side of a run (no cluster: tests/e2e/sim has that)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from services.bench.arrivals import schedule
from services.bench.client import RequestRecord as BenchRecord
from services.bench.metrics import summarize
from services.sim.calibrate import (
    MOCK_KV_BYTES_PER_TOKEN,
    REPO,
    Overheads,
    run_sim,
    sim_config,
)
from services.sim.calibrate_compare import Figures, compare, table
from services.sim.calibrate_workloads import PRESETS, XEON_PROFILE, build, sample_conversations
from services.sim.profile_check import CheckedStep, ProfileCheck
from services.sim.records import GapSamples, RequestRecord, SimResult
from services.sim.report import summary
from services.steptime.model import BatchShape

SCALE_MOCK = str(REPO / "configs" / "scale-mock.yaml")
MOCK_ENGINE = ["engine.runner=mock", "model.path=/nonexistent", "engine.mock.step_base_s=0.004",
               "engine.mock.per_prefill_token_s=0.00004", "engine.mock.per_decode_seq_s=0.0005",
               "engine.max_num_batched_tokens=256", "engine.max_num_seqs=8",
               "engine.num_kv_blocks=512"]
REAL = Figures(completed=10, ttft_mean_ms=100.0, ttft_p90_ms=200.0, itl_mean_ms=30.0,
               prefix_hit_rate=0.5, tpot_mean_ms=30.0, e2e_mean_ms=500.0)
SIM = Figures(completed=10, ttft_mean_ms=92.0, ttft_p90_ms=230.0, itl_mean_ms=30.3,
              prefix_hit_rate=0.5, tpot_mean_ms=33.0, e2e_mean_ms=450.0)


def test_every_figure_has_its_error_and_the_targeted_ones_a_verdict() -> None:
    rows = {r.figure: r for r in compare("chat", REAL, SIM)}
    assert list(rows) == ["ttft_mean_ms", "ttft_p90_ms", "itl_mean_ms", "prefix_hit_rate",
                          "tpot_mean_ms", "e2e_mean_ms"]
    assert rows["ttft_mean_ms"].error_pct == pytest.approx(-8.0)
    assert rows["ttft_mean_ms"].within is True
    assert rows["ttft_p90_ms"].error_pct == pytest.approx(15.0)
    assert rows["ttft_p90_ms"].within is False
    assert rows["itl_mean_ms"].error_pct == pytest.approx(1.0)
    assert rows["prefix_hit_rate"].error_pct == pytest.approx(0.0)
    # information only: an error, no verdict
    assert rows["tpot_mean_ms"].error_pct == pytest.approx(10.0)
    assert rows["tpot_mean_ms"].within is None
    assert rows["e2e_mean_ms"].error_pct == pytest.approx(-10.0)
    assert rows["e2e_mean_ms"].within is None


def test_a_zero_real_figure_has_no_relative_error() -> None:
    real = Figures(5, 100.0, 100.0, 30.0, 0.0, 30.0, 100.0)
    same = compare("w", real, real)
    hit = next(r for r in same if r.figure == "prefix_hit_rate")
    assert hit.error_pct is None and hit.within is True
    off = compare("w", real, Figures(5, 100.0, 100.0, 30.0, 0.02, 30.0, 100.0))
    hit = next(r for r in off if r.figure == "prefix_hit_rate")
    assert hit.error_pct is None and hit.within is False


def test_the_table_shows_every_figure_and_counts_the_misses() -> None:
    text = table(compare("chat", REAL, SIM) + compare("long", REAL, REAL))
    lines = text.splitlines()
    assert len(lines) == 2 + 12 + 1
    assert "mean TTFT ms" in lines[2] and "100.0" in lines[2] and "92.0" in lines[2]
    assert "-8.0%" in lines[2] and lines[2].endswith("ok (10%)")
    assert "+15.0%" in lines[3] and lines[3].endswith("MISS (10%)")
    assert "0.500" in lines[5]  # a hit rate with three decimals
    assert lines[6].endswith("(info)") and "+10.0%" in lines[6]
    assert lines[-1] == "7/8 targeted figures within their targets"
    # against the real engine the target is 15%: +15.0% is within it
    real_engine = table(compare("real", REAL, SIM, 15.0)).splitlines()
    assert real_engine[3].endswith("ok (15%)") and real_engine[-1] == "4/4 targeted figures within their targets"


def _bench_record(i: int, t0: float, ttft: float, gaps: list[float], prompt: int,
                  cached: int) -> BenchRecord:
    times = [t0 + ttft]
    for g in gaps:
        times.append(times[-1] + g)
    return BenchRecord(i, prompt, send_time=t0, first_token_time=times[0], chunk_times=times,
                       end_time=times[-1], ok=True, prompt_tokens=prompt,
                       completion_tokens=len(times), cached_tokens=cached)


def test_real_and_simulated_figures_have_the_same_definitions() -> None:
    # the same two requests, once as the bench client recorded them, once as the simulator
    real = Figures.of_bench(summarize([_bench_record(0, 0.0, 0.1, [0.03, 0.03], 100, 0),
                                       _bench_record(1, 1.0, 0.3, [0.05], 100, 50)], 2.0))
    recs = [RequestRecord(0, 0.0, 100, 3, first_token_s=0.1, end_s=0.16, tokens_out=3,
                          last_token_s=0.16, completed=True, cached_tokens=0),
            RequestRecord(1, 1.0, 100, 2, first_token_s=1.3, end_s=1.35, tokens_out=2,
                          last_token_s=1.35, completed=True, cached_tokens=50)]
    gaps = GapSamples()
    gaps.add(0.03, 2)
    gaps.add(0.05)
    sim = Figures.of_sim(summary(SimResult(recs, gaps, [], [], [], 0.0, {}, 2.0, 0.1)))
    for key in ("completed", "ttft_mean_ms", "ttft_p90_ms", "itl_mean_ms", "prefix_hit_rate",
                "tpot_mean_ms", "e2e_mean_ms"):
        # NOTE: the sim report rounds ms to the microsecond and fractions to 1e-4
        assert getattr(sim, key) == pytest.approx(getattr(real, key), abs=1e-3), key
    assert real.ttft_mean_ms == pytest.approx(200.0)
    assert real.itl_mean_ms == pytest.approx(110 / 3)
    assert real.prefix_hit_rate == pytest.approx(0.25)


def test_the_presets_send_what_the_bench_builds(tmp_path: Path) -> None:
    chat = build("chat", None, True, None, None, None, 24, 0)
    assert len(chat.requests) == PRESETS["chat"].quick_requests
    assert chat.arrivals.kind == "poisson" and chat.arrivals.rate == PRESETS["chat"].rate
    assert "decode.replicas=8" in chat.overrides
    long = build("long-disagg", 30, False, 1.0, None, None, 24, 1, ("engine.max_num_seqs=8",))
    assert len(long.requests) == 30 and long.arrivals.rate == 1.0
    assert long.overrides[-1] == "engine.max_num_seqs=8"  # --set comes last: it wins
    assert {r.prompt_len for r in long.requests} == {64, 768}
    real_long = build("real-long", None, False, None, None, None, 24, 0)
    assert len(real_long.requests) == PRESETS["real-long"].num_requests
    assert {r.prompt_len for r in real_long.requests} == {64, 512}
    assert real_long.config.endswith("agg.yaml") and real_long.arrivals.rate == 0.75
    trace = tmp_path / "t.jsonl"
    rows = [{"timestamp": 1000 * i, "input_length": 1024, "output_length": 64,
             "hash_ids": [0, 1 + i % 4, 100 + i]} for i in range(12)]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert sample_conversations(trace, 2, tmp_path / "s.jsonl") == 6
    conv = build("conversation", 0, False, None, 10.0, trace, 2, 0)
    assert len(conv.requests) == 6
    assert [r.arrival_s for r in conv.requests] == [1.0, 3.0, 5.0, 7.0, 9.0, 11.0]
    assert conv.arrivals.kind == "trace" and conv.arrivals.speedup == 10.0
    assert all(r.prompt_len == 32 and r.output_len == 2 for r in conv.requests)  # 1/32
    with pytest.raises(ValueError, match="no conversation"):
        build("conversation", 0, False, None, None, trace, 1000, 0)


def test_the_simulation_gets_the_runs_config_and_send_times() -> None:
    cal = build("long-disagg", 5, False, None, None, None, 24, 0, ("sim.load_interval_s=0.5",))
    cfg = sim_config(cal, SCALE_MOCK, Overheads(0.0123, 0.0155, [], []))
    assert cfg.sim.request_overhead_s == pytest.approx(0.0123)
    assert cfg.sim.kv_transfer_latency_s == pytest.approx(0.0155)
    assert cfg.sim.kv_bytes_per_token == MOCK_KV_BYTES_PER_TOKEN
    assert cfg.sim.load_interval_s == 0.5
    assert (cfg.decode.replicas, cfg.prefill.replicas) == (6, 2) and cfg.decode.disagg.enabled
    mine = build("long-disagg", 5, False, None, None, None, 24, 0,
                 ("sim.kv_bytes_per_token=100",))
    assert sim_config(mine, SCALE_MOCK, Overheads(0.0, None, [], [])).sim.kv_bytes_per_token == 100
    done = run_sim(cal, cfg)
    assert [r.index for r in done.records] == list(range(5))
    assert [r.prompt_tokens for r in done.records] == [r.prompt_len for r in cal.requests]
    assert [r.output_tokens for r in done.records] == [r.output_len for r in cal.requests]
    sent = schedule(cal.arrivals, 5, None, [r.arrival_s for r in cal.requests])
    assert [r.sent_s for r in done.records] == sent


def test_a_real_engine_is_calibrated_against_a_profile_only(tmp_path) -> None:
    import argparse

    from services.sim import calibrate
    from services.sim.calibrate_workloads import PRESETS

    assert any(o.startswith("engine.step_model=") for o in PRESETS["real-chat"].overrides)
    args = argparse.Namespace(
        workloads=["real-chat"], num_requests=None, quick=True, rate=None, speedup=None,
        trace=None, sample_mod=24, seed=0, config=None,
        overrides=["engine.step_model=mock"], log_dir=str(tmp_path), json_path=None, _argv=[])
    assert calibrate.main(args) == 2  # refused before any cluster starts
    args.overrides = [f"engine.step_model={tmp_path / 'missing.yaml'}"]
    assert calibrate.main(args) == 2


def test_each_real_engine_profile_is_checked_once_before_the_clusters(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import services.sim.calibrate as calibrate

    seen: list[str] = []

    def fake(config: str, overrides: list[str], path: str) -> ProfileCheck:
        seen.append(path)
        # close on average, a fifth off somewhere: stale
        return ProfileCheck(path, 0.056, 0.214, True, (CheckedStep(BatchShape(0, 0, 1, 64), 0.01, 0.0079),))

    monkeypatch.setattr(calibrate, "check_in_subprocess", fake)
    cals = [build(n, None, True, None, None, None, 24, 0) for n in ("chat", "real-chat", "real-long")]
    checks = calibrate.profile_checks(cals, None)
    # the mock workload has no profile; the two real ones share one, timed once
    assert seen == [XEON_PROFILE] and list(checks) == seen
    assert checks[seen[0]] == {"profile": XEON_PROFILE, "mean_error": 0.056, "max_error": 0.214,
                               "stale": True, "points": [{**asdict(BatchShape(0, 0, 1, 64)),
                                                          "seconds": 0.01, "profile_seconds": 0.0079}]}
    assert "WARNING: stale here" in capsys.readouterr().out


def test_the_check_runs_in_a_process_of_its_own_and_reads_its_verdict(tmp_path: Path) -> None:
    from services.sim.calibrate import ProfileCheckError, check_in_subprocess
    from services.steptime.profile import MeasuredStep, fit_profile

    slow = tmp_path / "slow.yaml"  # 20x the mock's own step: stale whatever the timing noise
    shapes = [BatchShape(0, 0, b, 64 * b) for b in (1, 2, 4, 8)] + [BatchShape(n, n * n) for n in (16, 64, 256)]
    fit_profile([MeasuredStep(s, 20 * (0.004 + 0.00004 * s.prefill_tokens + 0.0005 * s.decode_seqs))
                 for s in shapes]).save(slow)
    verdict = check_in_subprocess("configs/agg.yaml", MOCK_ENGINE, str(slow))
    assert verdict.profile == str(slow) and verdict.stale
    assert 10 < verdict.mean_error <= verdict.max_error  # the profile says ~20x: ~1900% off
    assert len(verdict.points) >= 10  # the quick grid's points, each timed beside the profile
    errors = [abs(p.error) for p in verdict.points]
    assert verdict.mean_error == pytest.approx(sum(errors) / len(errors))
    assert verdict.max_error == pytest.approx(max(errors))
    with pytest.raises(ProfileCheckError, match=r"(?s)checking the profile .*missing\.yaml against "
                       r"this machine failed \(tandem sim profile --check exited 1\):\n.*"
                       r"ProfileError: step-time profile not found"):
        check_in_subprocess("configs/agg.yaml", MOCK_ENGINE, str(tmp_path / "missing.yaml"))


def test_a_profile_check_that_fails_stops_calibrate_with_its_error_before_any_cluster(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The real engine cannot be built here (no model at model.path): `tandem sim profile
    --check` fails in its process, and calibrate says so as it says its other up-front
    errors, exit 2, with the check's last stderr lines and no traceback of its own."""
    import argparse

    from services.sim import calibrate

    logs = tmp_path / "logs"
    args = argparse.Namespace(
        workloads=["real-chat"], num_requests=None, quick=True, rate=None, speedup=None,
        trace=None, sample_mod=24, seed=0, config=None, overrides=["model.path=/nonexistent"],
        skip_profile_check=False, log_dir=str(logs), json_path=None, _argv=[])
    assert calibrate.main(args) == 2
    out, err = capsys.readouterr()
    first, *tail = err.rstrip().splitlines()
    assert first == (f"tandem sim calibrate: checking the profile {XEON_PROFILE} against this "
                     "machine failed (tandem sim profile --check exited 1):")
    assert 1 <= len(tail) <= calibrate.CHECK_STDERR_LINES
    assert "ModelNotFoundError: model path /nonexistent does not exist" in tail[-1]
    assert not logs.exists() and "== real-chat" not in out  # no cluster was started


def test_the_clusters_speed_is_timed_over_modelled_seconds_between_two_readings() -> None:
    from services.sim.calibrate import cluster_speeds

    before = {("modelled", "decode"): 1.0, ("timed", "decode"): 0.9, ("modelled", "prefill"): 2.0,
              ("timed", "prefill"): 2.0}
    after = {("modelled", "decode"): 3.0, ("timed", "decode"): 3.4, ("modelled", "prefill"): 2.0,
             ("timed", "prefill"): 2.0, ("modelled", "rows"): 0.5, ("timed", "rows"): 0.6}
    # prefill: no step between the readings, so no speed
    assert cluster_speeds(before, after) == pytest.approx({"decode": 1.25, "rows": 1.2})
    assert cluster_speeds(None, after) is None and cluster_speeds(before, None) is None


def test_a_model_at_the_clusters_speed_scales_each_fit_by_its_own() -> None:
    from services.sim.calibrate import at_speeds
    from services.steptime.chunk import StepCost
    from services.steptime.model import MockStepModel

    base = MockStepModel(0.004, 0.001, 0.002)
    m = at_speeds(base, {"decode": 2.0, "prefill": 1.5, "rows": 1.2})
    assert m.row_tokens == 32  # the base knows no row steps: the CPU kernels' limit
    decode, rows, eager = BatchShape(decode_seqs=3), BatchShape(prefill_tokens=32), BatchShape(prefill_tokens=33)
    assert m.step_seconds(decode) == pytest.approx(2.0 * base.step_seconds(decode))
    assert m.step_seconds(rows) == pytest.approx(1.2 * base.step_seconds(rows))
    assert m.step_seconds(eager) == pytest.approx(1.5 * base.step_seconds(eager))
    # four steps of 32 prefill tokens each are row steps; of 33, not
    assert m.steps_seconds(BatchShape(prefill_tokens=128), 4) == pytest.approx(
        1.2 * base.steps_seconds(BatchShape(prefill_tokens=128), 4))
    assert m.steps_seconds(BatchShape(prefill_tokens=132), 4) == pytest.approx(
        1.5 * base.steps_seconds(BatchShape(prefill_tokens=132), 4))
    # the scheduler's step cost reads the scaled model, rows apart
    cost = StepCost.of(m)
    assert cost.decode_seconds(3, 0) == pytest.approx(m.step_seconds(decode))
    assert cost.rows is not None and cost.rows.per_token_s == pytest.approx(1.2 * 0.001)
    assert cost.per_token_s == pytest.approx(1.5 * 0.001)
    assert (m.reads_decode_context, m.overlap_pays) == (base.reads_decode_context, base.overlap_pays)
    # workers that ran no row step (a CUDA runner): every prefill step at prefill's speed
    gpu = at_speeds(base, {"decode": 0.9, "prefill": 1.1})
    assert gpu.row_tokens == 0 and gpu.step_seconds(rows) == pytest.approx(1.1 * base.step_seconds(rows))
    assert at_speeds(base, {}).step_seconds(decode) == pytest.approx(base.step_seconds(decode))


def test_the_workers_metrics_are_read_from_each_replica_and_summed(monkeypatch) -> None:
    import httpx

    from services.common.config import parse_config
    from services.sim import calibrate

    cfg = parse_config({}, ["decode.replicas=2", "decode.metrics_port=9400", "prefill.replicas=1",
                            "prefill.metrics_port=9500"])
    step = ('tandem_worker_engine_step_modelled_seconds_total{{kind="decode"}} {m}\n'
            'tandem_worker_engine_step_timed_seconds_total{{kind="decode"}} {t}\n')
    texts = {9400: step.format(m=1.0, t=1.5) + 'tandem_worker_prefill_total{where="remote"} 3.0\n',
             9401: step.format(m=2.0, t=2.5) + 'tandem_worker_prefill_total{where="remote"} 4.0\n',
             9500: step.format(m=4.0, t=4.0)}
    down: set[int] = set()

    class Reply:
        def __init__(self, text: str) -> None:
            self.text = text

    def get(url: str, timeout: float) -> Reply:
        port = int(url.split(":")[2].split("/")[0])
        if port in down:
            raise httpx.ConnectError("refused")
        return Reply(texts[port])

    monkeypatch.setattr(calibrate.httpx, "get", get)
    assert calibrate.remote_prefills(cfg) == 7  # decode workers only
    assert calibrate.step_seconds(cfg) == {("modelled", "decode"): 7.0, ("timed", "decode"): 8.0}
    texts[9500] = "# a prefill worker with no ITL target exports no step seconds\n"
    assert calibrate.step_seconds(cfg) is None
    down.add(9401)
    assert calibrate.remote_prefills(cfg) is None and calibrate.step_seconds(cfg) is None
