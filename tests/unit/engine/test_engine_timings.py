"""Where a token's time goes: the engine's step histogram by kind and each request's queue,
prefill and decode time (EngineTimings), on a mock engine whose steps take a known time."""

from __future__ import annotations

import time

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from services.common.config import MockRunnerConfig
from services.engine.batch import RunnerOutput, ScheduledBatch
from services.engine.engine import LLMEngine
from services.engine.stats_metrics import EngineStatsCollector
from services.engine.timings import StepKind
from tests.support.engine_factory import make_engine, mock_cfg, req

STEP_S = 0.002  # the mock device's time per step
# NOTE: the mock device's clock starts when a batch launches, a phase's when the scheduler
# reads its clock: lower bounds in whole steps hold to a few microseconds.
SLACK = 0.9


def timed_engine(overlap: bool) -> LLMEngine:
    cfg = mock_cfg(max_num_batched_tokens=64)
    cfg = cfg.model_copy(update={
        "overlap": overlap,
        "mock": MockRunnerConfig(step_base_s=STEP_S, per_prefill_token_s=0, per_decode_seq_s=0,
                                 vocab_size=1000, eos_token_id=2, eos_probability=0.0)})
    return make_engine(cfg)[0]


@pytest.mark.parametrize("overlap", [False, True])
def test_steps_are_counted_by_kind_and_request_phases_add_up(overlap: bool) -> None:
    eng = timed_engine(overlap)
    assert eng.overlap is overlap
    t_start = time.perf_counter()
    eng.add_request(req("a", list(range(10, 20)), max_tokens=5))
    outs = eng.step()  # a's prompt
    eng.add_request(req("b", list(range(30, 40)), max_tokens=3))
    while eng.has_unfinished():
        outs += eng.step()
    wall = time.perf_counter() - t_start
    assert [o.request_id for o in outs if o.finished] == ["b", "a"]

    t = eng.stats().timings
    # a prefills alone; then a decodes while b prefills; both decode (b: 2 more tokens);
    # a decodes alone (2 more). Overlap launches the same batches, one step earlier.
    counts = {k: t.step_seconds[k].count for k in StepKind}
    assert counts == {StepKind.PREFILL: 1, StepKind.MIXED: 1, StepKind.DECODE: 3}
    steps = sum(t.step_seconds[k].total for k in StepKind)
    assert 0 < steps <= wall
    for h in (t.queue_seconds, t.prefill_seconds, t.decode_seconds):
        assert h.count == 2 and h.total > 0
    if not overlap:
        # Each step waits for its forward: a's 5 steps, b's 3 (2 shared), one forward to
        # each first token, one per token after it (a 4 more, b 2 more). NOTE: overlapped,
        # a token's read-back may come late by however long the host took (a loaded
        # machine), while the next batch computes on: no lower bound holds there.
        assert steps >= 5 * STEP_S * SLACK
        assert t.prefill_seconds.total >= 2 * STEP_S * SLACK
        assert t.decode_seconds.total >= 6 * STEP_S * SLACK
    # the three phases tile each request's life, all inside the test's wall time
    phases = t.queue_seconds.total + t.prefill_seconds.total + t.decode_seconds.total
    assert phases <= 2 * wall
    assert t.queue_seconds.total < t.prefill_seconds.total + t.decode_seconds.total


def test_phases_follow_the_scheduler_clock_exactly() -> None:
    """A request that waits for a seat: its queue time is the wait; a fake clock moves 1 s
    between steps and 0.5 s in each forward."""
    cfg = mock_cfg(max_num_seqs=1).model_copy(update={"overlap": False})
    eng = make_engine(cfg)[0]
    now = [100.0]
    eng.scheduler.clock = lambda: now[0]
    execute = eng.runner.execute

    def timed_execute(batch: ScheduledBatch) -> RunnerOutput:
        now[0] += 0.5
        return execute(batch)

    eng.runner.execute = timed_execute  # type: ignore[method-assign]
    eng.add_request(req("a", [5, 6, 7], max_tokens=2))
    eng.add_request(req("b", [8, 9, 10], max_tokens=2))
    while eng.has_unfinished():
        now[0] += 1.0
        eng.step()
    t = eng.stats().timings
    # a: scheduled at 101 (queued 1 s), first token at 101.5, last at 103;
    # b: waits for a's seat until 104, first token at 104.5, last at 106.
    assert (t.queue_seconds.count, t.queue_seconds.total) == (2, 1.0 + 4.0)
    assert (t.prefill_seconds.count, t.prefill_seconds.total) == (2, 0.5 + 0.5)
    assert (t.decode_seconds.count, t.decode_seconds.total) == (2, 1.5 + 1.5)


def test_collector_exports_the_step_and_request_histograms() -> None:
    eng = timed_engine(overlap=False)
    eng.add_request(req("a", list(range(10, 20)), max_tokens=3))
    while eng.has_unfinished():
        eng.step()
    reg = CollectorRegistry()
    reg.register(EngineStatsCollector(eng.stats))
    text = generate_latest(reg).decode()
    assert 'tandem_worker_engine_step_seconds_count{kind="prefill"} 1.0' in text
    assert 'tandem_worker_engine_step_seconds_count{kind="decode"} 2.0' in text
    assert 'tandem_worker_engine_step_seconds_count{kind="mixed"} 0.0' in text
    for phase in ("queue", "prefill", "decode"):
        assert f"tandem_worker_request_{phase}_seconds_count 1.0" in text
