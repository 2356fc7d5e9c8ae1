"""The closed-form prefill time equals the sum of the steps the scheduler would run."""

from __future__ import annotations

import pytest

from services.steptime.model import BatchShape, MockStepModel
from services.steptime.predict import prefill_seconds, prefill_shape
from services.steptime.profile import DecodeCost, PrefillCost, ProfileStepModel


def _chunks(tokens: int, chunk: int, start: int, seqs: int, ctx: int) -> list[BatchShape]:
    """The shape of each step, chunk by chunk, as the runner's batch_shape counts it."""
    out, pos = [], start
    while pos < start + tokens:
        n = min(chunk, start + tokens - pos)
        end = pos + n
        out.append(BatchShape(n, n * end, seqs, ctx, n * end if pos else 0, end if pos else 0))
        pos = end
    return out


@pytest.mark.parametrize("tokens, chunk, start", [
    (1, 512, 0), (512, 512, 0), (513, 512, 0), (2000, 512, 0), (2000, 512, 300),
    (100, 8192, 4096), (40960, 8192, 0), (7, 3, 5),
])
def test_the_summed_shape_is_the_sum_of_the_chunks(tokens: int, chunk: int, start: int) -> None:
    steps = _chunks(tokens, chunk, start, 4, 900)
    total, n = prefill_shape(tokens, chunk, start, 4, 900)
    assert n == len(steps)
    assert total == BatchShape(*(sum(getattr(s, f) for s in steps)
                                 for f in BatchShape.__dataclass_fields__))
    profile = ProfileStepModel(DecodeCost(0.01, 0.001, 1e-6),
                               PrefillCost(0.02, 1e-4, 1e-7, 2e-7, 1e-6, 3e-4, 2e-6))
    for model in (profile, MockStepModel(0.01, 2e-5, 2e-4)):
        assert prefill_seconds(model, tokens, chunk, start, 4, 900) == pytest.approx(
            sum(model.step_seconds(s) for s in steps), rel=1e-9)


def test_nothing_to_prefill_takes_no_time() -> None:
    assert prefill_shape(0, 512) == (BatchShape(), 0)
    assert prefill_seconds(MockStepModel(0.01, 1e-4, 1e-3), 0, 512, 100, 3) == 0.0
    with pytest.raises(ValueError, match="chunk"):
        prefill_shape(10, 0)
