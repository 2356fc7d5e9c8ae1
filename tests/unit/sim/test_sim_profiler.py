"""`tandem sim profile`'s measurement, on the mock runner: its device costs a known
``step_base_s + per_prefill_token_s * prefill_tokens + per_decode_seq_s * decode_seqs``,
so the profile fitted on it must find those coefficients."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from services.common.config import ClusterConfig, load_config
from services.engine.factory import build_engine
from services.sim.profile_check import CheckedStep, ProfileCheck
from services.sim.profiler import Grid, Profiler, check, grid_for, main, measure
from services.steptime.model import BatchShape
from services.steptime.profile import MeasuredStep, ProfileStepModel, fit_profile

MOCK = ["engine.runner=mock", "model.path=/nonexistent", "engine.mock.step_base_s=0.004",
        "engine.mock.per_prefill_token_s=0.00004", "engine.mock.per_decode_seq_s=0.0005",
        "engine.max_num_batched_tokens=256", "engine.max_num_seqs=8", "engine.num_kv_blocks=512"]


def _cfg(*extra: str) -> ClusterConfig:
    return load_config(None, [*MOCK, *extra])


def test_the_quick_grid_stays_inside_the_engines_limits() -> None:
    cfg = _cfg()
    grid = grid_for(cfg, 8192, quick=True)
    budget, capacity = cfg.engine.max_num_batched_tokens, cfg.engine.num_kv_blocks * cfg.engine.block_size
    assert {n for n, _ in grid.prefill} == {16, 64, 256}
    assert all(n <= budget and p + n <= capacity and p % cfg.engine.block_size == 0
               for n, p in grid.prefill)
    assert max(b for b, _ in grid.decode) == cfg.engine.max_num_seqs
    assert all(b * c < capacity for b, c in grid.decode)
    assert all(n < budget for n in grid.mixed)


def test_the_profiler_records_the_shapes_it_asked_for() -> None:
    profiler = Profiler(build_engine(_cfg()).engine)
    assert profiler.serve_overlapped  # the mock overlaps: its forward time is what is fitted
    step = profiler.prefill(64, 128)
    assert step.shape == BatchShape(64, 64 * 192, 0, 0, 64 * 192, 192)
    assert step.seconds > 0
    steps, mixed = profiler.decode(3, 100, 4, (32,))
    assert [s.shape.decode_seqs for s in steps] == [3] * 4
    assert all(s.shape.prefill_tokens == 0 for s in steps)
    assert [(m.shape.prefill_tokens, m.shape.decode_seqs) for m in mixed] == [(32, 3)]
    assert not profiler.engine.has_unfinished()
    profiler.engine.check_integrity()


def test_a_prefix_evicted_since_it_was_computed_is_computed_again() -> None:
    """The warm-up computes the largest prefix first; the points before its own (here six
    prompts through a 1,024-token pool) evict it, and its point must still hit it."""
    profiler = Profiler(build_engine(_cfg("engine.num_kv_blocks=64")).engine)
    profiler.prefill(16, 256)
    for _ in range(6):
        profiler.prefill(256, 0)
    step = profiler.prefill(16, 256)
    assert step.shape == BatchShape(16, 16 * 272, 0, 0, 16 * 272, 272)
    profiler.engine.check_integrity()


def test_the_profile_of_the_mock_finds_its_costs() -> None:
    cfg = _cfg()
    engine = build_engine(cfg).engine
    grid = Grid(prefill=((16, 0), (64, 0), (128, 0), (256, 0), (64, 256)), decode=((1, 32), (4, 32), (8, 64)),
                mixed=(16, 128), repeats=3, decode_steps=6)
    points = list(measure(Profiler(engine), grid))
    # NOTE: what each point measured is wall-clock time (the mock sleeps): only the shapes
    # are checked here; test_sim_profile.py checks the fit on exact synthetic points.
    assert {p.shape.prefill_tokens for p in points} >= {16, 64, 128, 256}
    assert {p.shape.decode_seqs for p in points if not p.shape.prefill_tokens} == {1, 4, 8}
    model = fit_profile(points)
    assert all(v >= 0 for v in (model.decode.base_s, model.decode.per_seq_s,
                                model.prefill.base_s, model.prefill.per_token_s))


def test_main_writes_a_profile_that_loads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "mock.yaml"
    args = argparse.Namespace(config=None, overrides=MOCK, out=str(out), check=None, quick=True,
                              json_path=None)
    assert main(args) == 0
    model = ProfileStepModel.load(out)
    assert model.measured_on["device"] == "mock" and model.measured_on["timed"] == "forward"
    assert model.overlap_pays  # the mock runner overlaps: the simulation models that loop
    assert len(model.points) >= 10
    printed = capsys.readouterr().out
    assert "fit error over all steps" in printed and f"wrote {out}" in printed


def _exact_points(scale: float) -> list[MeasuredStep]:
    """Steps of a device costing 5 ms + 1 ms a sequence and 10 ms + 0.2 ms a prompt token,
    every time times ``scale``."""
    points = [MeasuredStep(BatchShape(0, 0, b, 64 * b), scale * (0.005 + 0.001 * b))
              for b in (1, 2, 4, 8, 16)]
    points += [MeasuredStep(BatchShape(n, n * n), scale * (0.010 + 0.0002 * n))
               for n in (16, 32, 64, 128, 256, 512)]
    return points


def test_check_reports_how_far_a_profile_is_from_steps_timed_now(
        capsys: pytest.CaptureFixture[str]) -> None:
    profile = fit_profile(_exact_points(1.0))
    assert check(profile, _exact_points(1.0)).max == pytest.approx(0.0, abs=1e-3)
    slower = check(profile, _exact_points(1.25))  # the machine now takes a quarter longer
    assert slower.mean == pytest.approx(0.2, abs=1e-3) and slower.max == pytest.approx(0.2, abs=1e-3)
    assert "-20.0%" in capsys.readouterr().out


def test_check_exits_1_against_a_profile_of_another_machine(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A profile 20x slower than the mock's sleeps: stale whatever this machine's timing noise."""
    slow = tmp_path / "slow.yaml"
    fit_profile([MeasuredStep(p.shape, 20 * (0.004 + 0.00004 * p.shape.prefill_tokens
                                              + 0.0005 * p.shape.decode_seqs))
                 for p in _exact_points(1.0)]).save(slow)
    verdict = tmp_path / "verdict.json"
    args = argparse.Namespace(config=None, overrides=MOCK, out=None, check=str(slow), quick=False,
                              json_path=str(verdict))
    assert main(args) == 1
    printed = capsys.readouterr().out
    assert "profile this machine again" in printed and "wrote" not in printed
    doc = json.loads(verdict.read_text())
    assert doc["command"].startswith("tandem") and doc["machine"]["cores"]
    read = ProfileCheck.from_json(doc)
    assert read.profile == str(slow) and read.stale and 10 < read.mean_error <= read.max_error
    # the points as printed, each timed now beside the profile's time and its error
    rows = [line for line in printed.splitlines() if line.split()[:1] and line.split()[0].isdigit()]
    assert len(read.points) == len(rows) >= 10
    profile = ProfileStepModel.load(slow)
    for p in read.points:
        assert p.profile_seconds == pytest.approx(profile.step_seconds(p.shape))
        assert f"{p.error * 100:.1f}%" in printed
    assert read.max_error == pytest.approx(max(abs(p.error) for p in read.points))


def test_the_verdict_round_trips_through_its_json() -> None:
    verdict = ProfileCheck("p.yaml", 0.05, 0.2, False, (
        CheckedStep(BatchShape(0, 0, 4, 256), 0.012, 0.0114),
        CheckedStep(BatchShape(64, 64 * 576, 0, 0, 64 * 576, 576), 0.031, 0.0372)))
    assert ProfileCheck.from_json(json.loads(json.dumps(verdict.to_json()))) == verdict
    assert verdict.points[0].error == pytest.approx(-0.05)
    with pytest.raises(ValueError, match="stale"):
        ProfileCheck.from_json({**verdict.to_json(), "stale": "false"})


def test_json_goes_with_check_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = argparse.Namespace(config=None, overrides=MOCK, out=str(tmp_path / "p.yaml"), check=None,
                              quick=True, json_path=str(tmp_path / "v.json"))
    assert main(args) == 2
    assert "--json is the verdict of --check" in capsys.readouterr().err
    assert not (tmp_path / "p.yaml").exists() and not (tmp_path / "v.json").exists()


def test_the_cli_parses_sim_profile_beside_the_replays_options() -> None:
    from services.cli import build_parser

    args = build_parser().parse_args(["sim", "profile", "-c", "configs/local.yaml", "--set",
                                      "engine.threads=2", "--out", "p.yaml", "--quick"])
    assert (args._key, args.config, args.overrides, args.out, args.quick) == (
        ("sim", "profile"), "configs/local.yaml", ["engine.threads=2"], "p.yaml", True)
    assert build_parser().parse_args(["sim", "--trace", "t.jsonl"])._key == ("sim",)
    checked = build_parser().parse_args(["sim", "profile", "--check", "p.yaml", "--json", "v.json"])
    assert (checked.check, checked.out, checked.json_path) == ("p.yaml", None, "v.json")
    with pytest.raises(SystemExit):  # one of --out and --check, not both
        build_parser().parse_args(["sim", "profile", "--out", "a.yaml", "--check", "b.yaml"])
