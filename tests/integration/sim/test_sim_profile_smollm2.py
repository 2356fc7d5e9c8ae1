"""`tandem sim profile --quick` on the real SmolLM2: it measures both step kinds, writes a
profile that loads back, and the profile's stated error is what it does on its points."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.cli import main
from services.common.config import load_config
from services.steptime.profile import ProfileStepModel, step_model_for

pytestmark = pytest.mark.model


def test_quick_profile_predicts_its_points_within_its_stated_error(
        smollm2_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "profile.yaml"
    assert main(["sim", "profile", "--quick", "--out", str(out), "--set", "engine.threads=1"]) == 0
    model = step_model_for(load_config(None, [f"engine.step_model={out}"]))
    assert isinstance(model, ProfileStepModel)
    decode = [p for p in model.points if not p.shape.prefill_tokens]
    prefill = [p for p in model.points if p.shape.prefill_tokens]
    assert len(decode) >= 3 and len(prefill) >= 3
    assert any(p.shape.prefill_prefix_context for p in prefill)  # a chunk after a cached prefix
    assert any(p.shape.decode_seqs for p in prefill)  # decodes beside a prefill
    errors = []
    for p in model.points:
        err = abs(model.step_seconds(p.shape) - p.seconds) / p.seconds
        # NOTE: the file keeps errors to 4 decimals
        assert err <= model.error.max + 1e-4, p
        errors.append(err)
    assert sum(errors) / len(errors) == pytest.approx(model.error.mean, abs=1e-4)
    # more work costs more: tokens in a prefill, context in a decode
    assert model.prefill.per_token_s > 0 and model.decode.per_context_s > 0
    on = model.measured_on
    assert model.overlap_pays == (on["timed"] == "forward")
    assert on["device"] == "cpu" and on["torch_threads"] == 1
    assert on["model_path"] == str(smollm2_path)
    assert {"dtype", "quantization", "cpu_isa", "cpu_model", "cpu_flags", "block_size", "date"} <= set(on)
