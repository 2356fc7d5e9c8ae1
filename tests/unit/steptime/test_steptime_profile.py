"""Fitted step-time profiles: the fit, the YAML round trip, and the model a config names."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from services.common.config import load_config
from services.steptime.model import BatchShape, MockStepModel
from services.steptime.profile import (
    SHIPPED_CPU_PROFILE,
    DecodeCost,
    MeasuredStep,
    PrefillCost,
    ProfileError,
    ProfileStepModel,
    fit_profile,
    nnls,
    step_model_for,
)

TRUE = ProfileStepModel(
    DecodeCost(base_s=0.008, per_seq_s=0.0009, per_context_s=1.5e-5),
    PrefillCost(base_s=0.02, per_token_s=0.0013, per_fresh_context_s=1.7e-7,
                per_prefix_context_s=5e-7, per_prefix_end_s=1.2e-5, per_decode_seq_s=0.002,
                per_decode_context_s=3e-5))
DECODE_NAMES = ("base_s", "per_seq_s", "per_context_s")
PREFILL_NAMES = ("base_s", "per_token_s", "per_fresh_context_s", "per_prefix_context_s",
                 "per_prefix_end_s", "per_decode_seq_s", "per_decode_context_s")


def _prefill(n: int, prefix: int, seqs: int = 0, context: int = 0) -> BatchShape:
    work = n * (prefix + n)
    return BatchShape(n, work, seqs, seqs * context, *((work, prefix + n) if prefix else (0, 0)))


def _grid() -> list[BatchShape]:
    """Prefills after a prefix, decodes and mixed steps, as the profiler measures them."""
    shapes = [_prefill(n, p) for n in (16, 64, 256, 1024) for p in (0, 512, 2048, 4096)]
    shapes += [BatchShape(0, 0, b, b * c) for b in (1, 4, 16, 64) for c in (32, 256, 1024)]
    shapes += [_prefill(n, 0, b, c) for n in (16, 128) for b, c in ((2, 100), (8, 300), (4, 1000))]
    return shapes


def _points(noise: Callable[[int], float] = lambda i: 1.0) -> list[MeasuredStep]:
    return [MeasuredStep(s, TRUE.step_seconds(s) * noise(i)) for i, s in enumerate(_grid())]


def test_the_fit_recovers_known_coefficients() -> None:
    fitted = fit_profile(_points())
    for cost, true, names in ((fitted.decode, TRUE.decode, DECODE_NAMES),
                              (fitted.prefill, TRUE.prefill, PREFILL_NAMES)):
        for name in names:
            assert getattr(cost, name) == pytest.approx(getattr(true, name), rel=1e-6), name
    assert fitted.error.max < 1e-6
    assert fitted.decode_error.max < 1e-6 and fitted.prefill_error.max < 1e-6


def test_the_fit_under_noise_is_within_the_noise() -> None:
    rng = random.Random(0)
    fitted = fit_profile(_points(lambda i: rng.uniform(0.97, 1.03)))
    assert fitted.error.max < 0.08
    assert fitted.error.mean < 0.03
    assert fitted.prefill.per_token_s == pytest.approx(TRUE.prefill.per_token_s, rel=0.1)
    assert fitted.decode.per_context_s == pytest.approx(TRUE.decode.per_context_s, rel=0.1)


def test_a_point_slowed_by_other_work_does_not_drag_the_fit() -> None:
    # One decode and one prefill point measured while another process took the core. Plain
    # least squares moves per_prefix_end_s by 69% for them; the reweighted fit stays close.
    fitted = fit_profile(_points(lambda i: 2.0 if i in (3, 23) else 1.0))
    for cost, true, names in ((fitted.decode, TRUE.decode, DECODE_NAMES),
                              (fitted.prefill, TRUE.prefill, PREFILL_NAMES)):
        for name in names:
            assert getattr(cost, name) == pytest.approx(getattr(true, name), rel=0.03), name
    assert fitted.error.max == pytest.approx(0.5, rel=0.02)  # reported, not hidden


def test_the_reported_error_is_over_the_points() -> None:
    fitted = fit_profile(_points(lambda i: 1.1 if i == 0 else 1.0))
    errors = [abs(fitted.step_seconds(p.shape) - p.seconds) / p.seconds for p in fitted.points]
    assert fitted.error.max == pytest.approx(max(errors))
    assert fitted.error.mean == pytest.approx(sum(errors) / len(errors))
    assert fitted.prefill_error.max == fitted.error.max  # the bumped point is a prefill


def test_a_coefficient_the_data_pushes_negative_is_zero() -> None:
    # Decode steps that get cheaper with context: least squares would make that term negative.
    points = [MeasuredStep(BatchShape(0, 0, b, b * c), 0.01 + 0.001 * b - 1e-7 * b * c)
              for b in (1, 8, 32) for c in (64, 512)]
    points += [MeasuredStep(_prefill(n, 0), 0.01 + 0.001 * n) for n in (16, 128, 512)]
    fitted = fit_profile(points)
    assert fitted.decode.per_context_s == 0.0
    assert min(fitted.decode.base_s, fitted.decode.per_seq_s, fitted.prefill.per_token_s) >= 0


def test_nnls_matches_the_unconstrained_solution_when_that_is_non_negative() -> None:
    rng = np.random.default_rng(1)
    a = rng.uniform(0, 1, (20, 4))
    x = np.array([0.5, 2.0, 0.0, 1.0])
    assert nnls(a, a @ x) == pytest.approx(x, abs=1e-9)
    assert (nnls(a, a @ np.array([1.0, -1.0, 1.0, 1.0])) >= 0).all()


def test_too_few_points_of_a_kind_are_refused() -> None:
    decodes = [MeasuredStep(BatchShape(0, 0, b, b * 64), 0.01) for b in (1, 2, 4, 8)]
    with pytest.raises(ValueError, match="4 decode and 1 prefill"):
        fit_profile([*decodes, MeasuredStep(_prefill(16, 0), 0.01)])


def test_the_yaml_round_trips(tmp_path: Path) -> None:
    fitted = fit_profile(_points(lambda i: 1.02 if i % 2 else 0.99),
                         {"device": "cpu", "cpu_flags": ["avx2"], "torch_threads": 1}, overlap_pays=True)
    path = tmp_path / "profile.yaml"
    fitted.save(path)
    loaded = ProfileStepModel.load(path)
    assert loaded.points == fitted.points
    assert loaded.measured_on == fitted.measured_on
    assert loaded.decode == fitted.decode and loaded.prefill == fitted.prefill
    assert loaded.overlap_pays is True
    for got, want in ((loaded.error, fitted.error), (loaded.decode_error, fitted.decode_error),
                      (loaded.prefill_error, fitted.prefill_error)):
        assert (got.mean, got.max) == pytest.approx((want.mean, want.max), abs=1e-4)
    for s in _grid():
        assert loaded.step_seconds(s) == fitted.step_seconds(s)


def test_a_profile_reads_decode_context_unless_its_coefficients_are_zero() -> None:
    assert TRUE.reads_decode_context
    flat = replace(TRUE, decode=replace(TRUE.decode, per_context_s=0.0),
                   prefill=replace(TRUE.prefill, per_decode_context_s=0.0))
    assert not flat.reads_decode_context
    assert flat.step_seconds(BatchShape(0, 0, 4, 100)) == flat.step_seconds(BatchShape(0, 0, 4, 9000))


def test_step_model_for_mock_is_the_mock_runners_cost() -> None:
    cfg = load_config(None, ["engine.step_model=mock", "engine.mock.step_base_s=0.01",
                             "engine.mock.per_decode_seq_s=0.002"])
    model = step_model_for(cfg)
    assert model == MockStepModel.of(cfg.engine.mock)
    assert model.step_seconds(BatchShape(0, 0, 3, 90)) == pytest.approx(0.016)


def test_step_model_for_a_file_loads_it(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    fit_profile(_points()).save(path)
    model = step_model_for(load_config(None, [f"engine.step_model={path}"]))
    assert isinstance(model, ProfileStepModel)
    for shape in (_prefill(100, 500, 5, 400), BatchShape(0, 0, 7, 7 * 900)):
        assert model.step_seconds(shape) == pytest.approx(TRUE.step_seconds(shape), rel=1e-6)


GOOD = ("format: 1\ndecode: {base_s: 0.01, per_seq_s: 0.001, per_context_s: 0}\n"
        "prefill: {base_s: 0.02, per_token_s: 0.001, per_fresh_context_s: 0, per_prefix_context_s: 0,"
        " per_prefix_end_s: 0, per_decode_seq_s: 0, per_decode_context_s: 0}\noverlap_pays: true\n")


@pytest.mark.parametrize("text, match", [
    (None, "not found"),
    ("a: [", "cannot be read"),
    ("- 1\n- 2\n", "cannot be read"),
    (GOOD.replace("format: 1", "format: 0"), "not a format-1 profile"),
    (GOOD.replace("per_seq_s: 0.001, ", ""), "per_seq_s"),
    (GOOD.replace("per_token_s: 0.001", "per_token_s: -1"), "negative"),
    (GOOD.replace("overlap_pays: true", "overlap_pays: 3"), "overlap_pays"),
    (GOOD, "fit"),  # no fit section: not what `tandem sim profile` writes
])
def test_a_missing_or_bad_file_is_a_clear_error(tmp_path: Path, text: str | None, match: str) -> None:
    path = tmp_path / "bad.yaml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ProfileError, match=match) as e:
        step_model_for(load_config(None, [f"engine.step_model={path}"]))
    assert str(path) in str(e.value)


def test_auto_is_the_mock_cost_for_the_mock_runner_and_the_shipped_profile_otherwise() -> None:
    mock = load_config(None, ["engine.runner=mock"])
    assert step_model_for(mock) == MockStepModel.of(mock.engine.mock)
    shipped = step_model_for(load_config(None, ["engine.runner=torch"]))
    assert isinstance(shipped, ProfileStepModel)
    assert shipped == ProfileStepModel.load(SHIPPED_CPU_PROFILE)
    assert shipped.measured_on["device"] == "cpu"


def test_steps_seconds_of_summed_shapes_is_the_sum_of_the_steps() -> None:
    shapes = [_prefill(512, 0, 3, 300), _prefill(512, 512, 3, 303), _prefill(100, 1024, 3, 306)]
    total = BatchShape(*(sum(getattr(s, f) for s in shapes) for f in BatchShape.__dataclass_fields__))
    for model in (TRUE, MockStepModel(0.01, 1e-4, 2e-3)):
        assert model.steps_seconds(total, 3) == pytest.approx(
            sum(model.step_seconds(s) for s in shapes), rel=1e-9)


# A CPU's one-call step: its rows attend their whole context, so a small chunk after a long
# prefix costs more per unit of context than the eager forward's line says.
ROWS = PrefillCost(base_s=0.009, per_token_s=0.0009, per_fresh_context_s=7.8e-6,
                   per_prefix_context_s=1.7e-6, per_prefix_end_s=0.0, per_decode_seq_s=0.0018,
                   per_decode_context_s=6.4e-6)
TRUE_ROWS = replace(TRUE, rows=ROWS, row_tokens=32)


def _row_grid() -> list[BatchShape]:
    """_grid's shapes and the row steps the profiler measures (16 and 32 tokens)."""
    return [*_grid(), *(_prefill(32, p) for p in (0, 512, 2048, 4096)),
            *(_prefill(16, 0, b, c) for b, c in ((1, 300), (16, 1000)))]


def test_row_steps_get_a_cost_of_their_own() -> None:
    """Fitted with the runner's row_step_tokens, the steps on either side of it recover
    their own costs; one line over both (row_tokens 0) cannot follow them."""
    points = [MeasuredStep(s, TRUE_ROWS.step_seconds(s)) for s in _row_grid()]
    fitted = fit_profile(points, row_tokens=32)
    assert fitted.row_tokens == 32 and fitted.rows is not None
    for cost, true in ((fitted.prefill, TRUE.prefill), (fitted.rows, ROWS)):
        for name in PREFILL_NAMES:
            assert getattr(cost, name) == pytest.approx(getattr(true, name), rel=1e-6, abs=1e-12), name
    assert fitted.error.max < 1e-6 and fitted.rows_error.max < 1e-6
    one_line = fit_profile(points)
    assert one_line.rows is None and one_line.prefill_error.max > 0.1
    deep = _prefill(16, 4096)  # a row step after a long prefix
    assert fitted.step_seconds(deep) == pytest.approx(ROWS.base_s + ROWS.per_token_s * 16
                                                      + ROWS.per_prefix_context_s * deep.prefill_context)


def test_rows_need_points_on_both_sides_of_the_line() -> None:
    """Too few row steps (or none past the line): one prefill cost, as before."""
    points = [MeasuredStep(s, TRUE.step_seconds(s)) for s in _grid() if s.prefill_tokens != 16]
    assert fit_profile(points, row_tokens=32).rows is None


def test_steps_are_row_steps_only_when_each_fits_the_line() -> None:
    assert TRUE_ROWS.runs_as_rows(_prefill(32, 0), 1)
    assert not TRUE_ROWS.runs_as_rows(_prefill(33, 0), 1)
    assert TRUE_ROWS.runs_as_rows(BatchShape(prefill_tokens=64), 2)  # two steps of 32
    assert not TRUE_ROWS.runs_as_rows(BatchShape(decode_seqs=4), 1)
    assert not TRUE.runs_as_rows(_prefill(16, 0), 1)


def test_a_profile_with_rows_round_trips_and_one_without_still_loads(tmp_path: Path) -> None:
    points = [MeasuredStep(s, TRUE_ROWS.step_seconds(s) * (1.01 if i % 2 else 0.99))
              for i, s in enumerate(_row_grid())]
    fitted = fit_profile(points, row_tokens=32)
    path = tmp_path / "rows.yaml"
    fitted.save(path)
    loaded = ProfileStepModel.load(path)
    assert loaded.rows == fitted.rows and loaded.row_tokens == 32
    assert (loaded.rows_error.mean, loaded.rows_error.max) == pytest.approx(
        (fitted.rows_error.mean, fitted.rows_error.max), abs=1e-4)
    for s in _row_grid():
        assert loaded.step_seconds(s) == fitted.step_seconds(s)
    old = tmp_path / "old.yaml"
    fit_profile(_points()).save(old)
    assert "rows" not in old.read_text()
    assert ProfileStepModel.load(old).rows is None
    bad = tmp_path / "bad.yaml"
    bad.write_text(path.read_text().replace("row_tokens: 32", "row_tokens: 0"))
    with pytest.raises(ProfileError, match="row_tokens"):
        ProfileStepModel.load(bad)
