"""The shape of a step, as the simulator's runner costs it and the profiler records it."""

from __future__ import annotations

from services.api.sampling import SamplingParams
from services.engine.batch import ScheduledBatch, ScheduledSeq, batch_shape
from services.steptime.model import BatchShape


def test_a_batch_shape_counts_one_token_slices_as_decodes() -> None:
    greedy = SamplingParams(temperature=0)
    batch = ScheduledBatch([ScheduledSeq("a", [5] * 100, 512, [0], True, greedy),
                            ScheduledSeq("b", [7], 40, [1], True, greedy),
                            ScheduledSeq("c", [9], 9, [2], True, greedy)])
    assert batch_shape(batch) == BatchShape(100, 100 * 612, 2, 41 + 10, 100 * 612, 612)
    fresh = ScheduledBatch([ScheduledSeq("a", [5] * 100, 0, [0], True, greedy)])
    assert batch_shape(fresh) == BatchShape(100, 100 * 100)
