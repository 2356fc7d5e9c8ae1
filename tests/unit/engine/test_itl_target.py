"""engine.itl_target_ms: each step's prefill fits the target beside the running decodes (at
least one block a step), whether or not others wait; the decode worker's prediction chunks a
local prefill as the scheduler does (services/steptime/chunk.py, the one place)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.common.config import DisaggConfig, EngineConfig
from services.decode.disagg import DecisionReason, WorkerTimes, decide_prefill
from services.engine.batch import ScheduledBatch, batch_shape
from services.engine.engine import LLMEngine
from services.engine.runner.base import RunnerInfo
from services.engine.runner.mock_runner import MockRunner
from services.engine.scheduler import LONE_BOUND_REQUESTS
from services.steptime.chunk import (
    MAX_PLAN_MARGIN,
    PLAN_SPREADS,
    SPEED_WEIGHT,
    STEP_SWING,
    ChunkLimit,
    DeviceSpeed,
    FitSpeed,
    StepCost,
    chunk_limit_for,
)
from services.steptime.model import BatchShape, MockStepModel
from services.steptime.predict import prefill_shape
from services.steptime.profile import SHIPPED_CPU_PROFILE, DecodeCost, PrefillCost, ProfileStepModel
from tests.support.engine_factory import EOS, mock_cfg, req

PROFILE = ProfileStepModel.load(SHIPPED_CPU_PROFILE)


@given(st.integers(1, 4000), st.integers(0, 4000), st.integers(0, 64), st.integers(0, 64 * 2000))
def test_the_step_cost_is_the_models_own(tokens: int, start: int, seqs: int, context: int) -> None:
    cost = StepCost.of(PROFILE)
    shape, steps = prefill_shape(tokens, tokens, start, seqs, context)
    assert steps == 1
    got = cost.fixed_seconds(seqs, context) + cost.slice_seconds(tokens, start)
    assert got == pytest.approx(PROFILE.step_seconds(shape), rel=1e-9)
    # and a whole step's shape, with prefill or without (what DeviceSpeed compares with)
    assert cost.shape_seconds(shape) == pytest.approx(PROFILE.step_seconds(shape), rel=1e-9)
    decodes = BatchShape(decode_seqs=seqs, decode_context=context)
    assert cost.shape_seconds(decodes) == pytest.approx(PROFILE.step_seconds(decodes), rel=1e-9)


@given(st.floats(0.0, 2.0), st.integers(0, 6000))
def test_slice_tokens_is_the_most_that_fit(seconds: float, start: int) -> None:
    cost = StepCost.of(PROFILE)
    t = cost.slice_tokens(seconds, start)
    if t:
        assert cost.slice_seconds(t, start) <= seconds * (1 + 1e-9)
    assert cost.slice_seconds(t + 1, start) > seconds


# The modelled device: 4 ms a step, 1 ms a prefill token, 2 ms a decode (the mock runner
# itself computes for free: only the scheduler's limit reads this model).
MODEL = MockStepModel(0.004, 0.001, 0.002)


def engine(target_ms: float | None, budget: int = 256, lone_ms: float | None = None,
           order: str = "auto") -> tuple[LLMEngine, MockRunner]:
    cfg = mock_cfg(block_size=4, num_kv_blocks=512, max_num_seqs=16, max_num_batched_tokens=budget,
                   max_model_len=2048).model_copy(update={"itl_target_ms": target_ms,
                                                          "lone_step_target_ms": lone_ms,
                                                          "prefill_order": order})
    runner = MockRunner(cfg)
    return LLMEngine(runner, cfg, [EOS], step_model=MODEL), runner


def step(eng: LLMEngine, runner: MockRunner) -> ScheduledBatch:
    batch = eng.scheduler.schedule()
    eng.scheduler.update(batch, runner.execute(batch))
    eng.check_integrity()
    return batch


def prefill_tokens(batch: ScheduledBatch) -> int:
    return sum(len(s.token_ids) for s in batch.seqs if len(s.token_ids) > 1)


def start_streams(eng: LLMEngine, runner: MockRunner, n: int) -> None:
    for i in range(n):
        eng.add_request(req(f"d{i}", [100 + i] * 8, max_tokens=1000))
    while prefill_tokens(step(eng, runner)) or len(eng.scheduler.running) < n:
        pass


def overlap(eng: LLMEngine, runner: MockRunner) -> None:
    """Serve two requests at once, to the end: the engine has seen traffic overlap (the
    lone step bound applies, Scheduler.solo_arrivals)."""
    eng.add_request(req("o1", [50] * 8, max_tokens=1))
    eng.add_request(req("o2", [60] * 8, max_tokens=1))
    while eng.scheduler.seqs:
        step(eng, runner)


@pytest.mark.parametrize("others_wait", [False, True])
def test_steps_beside_running_streams_keep_the_target(others_wait: bool) -> None:
    eng, runner = engine(40.0)
    start_streams(eng, runner, 6)  # a decode-only step: 4 + 6 * 2 = 16 ms
    eng.add_request(req("long", list(range(200, 1200)), max_tokens=2))
    if others_wait:
        for i in range(3):
            eng.add_request(req(f"s{i}", [300 + i] * 40, max_tokens=2))
    chunks = []
    for _ in range(200):
        batch = step(eng, runner)
        assert MODEL.step_seconds(batch_shape(batch)) <= 0.040 + 1e-9
        chunks += [len(s.token_ids) for s in batch.seqs if s.request_id == "long" and not s.sample]
        if not eng.scheduler.waiting and all(s.num_generated for s in batch.seqs):
            break
    # 40 ms - 16 ms leaves 24 tokens of prefill beside the six streams, every step
    assert chunks == [24] * (1000 // 24)


def burst_steps(eng: LLMEngine, runner: MockRunner, bound_s: float) -> tuple[int, ScheduledBatch]:
    """Steps until a burst of 12 100-token prompts (behind 4 streams) is prefilled, each
    within ``bound_s`` by the model; and the first step."""
    start_streams(eng, runner, 4)  # a decode-only step: 4 + 4 * 2 = 12 ms
    for i in range(12):
        eng.add_request(req(f"b{i}", [500 + i] * 100, max_tokens=2))
    first = step(eng, runner)
    steps = 1
    while any(s.request_id.startswith("b") and s.num_computed_tokens < 100
              for s in (*eng.scheduler.waiting, *eng.scheduler.running)):
        assert MODEL.step_seconds(batch_shape(step(eng, runner))) <= bound_s + 1e-9
        steps += 1
    return steps, first


def test_a_burst_that_outnumbers_the_streams_stretches_the_target_by_that_ratio(
        monkeypatch: pytest.MonkeyPatch) -> None:
    eng, runner = engine(40.0)
    steps, first = burst_steps(eng, runner, 0.120)
    # 12 waiting against 4 streams: 3 x 40 ms, less the 12 ms of decodes, leaves 108 ms (the
    # first prompt whole; the plain target would leave 28 ms: 28 tokens)
    assert prefill_tokens(first) == 100
    assert 0.040 < MODEL.step_seconds(batch_shape(first)) <= 0.120 + 1e-9
    # once the prompts no longer outnumber the streams, the plain target again
    assert MODEL.step_seconds(batch_shape(step(eng, runner))) <= 0.040 + 1e-9
    # the same burst held to the plain target throughout
    plain = ChunkLimit.seconds_left
    monkeypatch.setattr(ChunkLimit, "seconds_left",
                        lambda self, seqs, context, queued=0: plain(self, seqs, context))
    eng, runner = engine(40.0)
    held, first = burst_steps(eng, runner, 0.040)
    assert prefill_tokens(first) == 28
    assert steps < 0.75 * held


def test_a_target_no_chunk_meets_still_prefills_one_block_a_step() -> None:
    eng, runner = engine(10.0)  # below even the decode-only step (16 ms)
    start_streams(eng, runner, 6)
    eng.add_request(req("long", list(range(200, 300)), max_tokens=1))
    eng.add_request(req("next", list(range(400, 440)), max_tokens=1))
    sizes = []
    while "long" in eng.scheduler.seqs:
        sizes.append(prefill_tokens(step(eng, runner)))
    assert sizes == [4] * 25  # one 4-token block a step; the request behind it waits


def test_no_running_stream_and_no_lone_target_takes_the_whole_budget_and_no_target_is_the_old_schedule(
) -> None:
    eng, runner = engine(40.0)
    eng.add_request(req("long", list(range(200, 1200)), max_tokens=1))
    assert prefill_tokens(step(eng, runner)) == 256
    for target in (None, 0.0):
        eng, runner = engine(target)
        assert eng.scheduler.chunk_limit is None
        start_streams(eng, runner, 6)
        eng.add_request(req("long", list(range(200, 1200)), max_tokens=1))
        assert prefill_tokens(step(eng, runner)) == 256 - 6


def test_a_step_with_no_stream_keeps_the_lone_target_so_an_arrival_waits_one_short_step() -> None:
    # 100 ms: 4 ms a step + 96 prefill tokens of 1 ms (MODEL)
    eng, runner = engine(40.0, lone_ms=100.0)
    overlap(eng, runner)
    eng.add_request(req("long", list(range(200, 500)), max_tokens=1))
    assert prefill_tokens(step(eng, runner)) == 96
    # a short that arrives mid-step starts beside the next slice (it is not held for the
    # long prompt's whole prefill, as one step of 256 tokens would have held it)
    eng.add_request(req("short", list(range(600, 608)), max_tokens=2))
    batch = step(eng, runner)
    sizes = {s.request_id: len(s.token_ids) for s in batch.seqs}
    assert sizes == {"short": 8, "long": 96 - 8}  # the short whole, first; the long the rest
    assert any(s.request_id == "short" and s.sample for s in batch.seqs)  # its first token now
    assert MODEL.step_seconds(batch_shape(batch)) <= 0.100 + 1e-9
    # the decode worker predicts that chunk for a lone local prefill
    limit = eng.scheduler.chunk_limit
    assert WorkerTimes(MODEL, 256, 0, 0, 0, 1, 0.0, limit).local_chunk(300, 0) == 96
    # a fifo prefill worker's prompt takes the whole budget: no stream or arrival waits on it
    eng, runner = engine(40.0, lone_ms=100.0, order="fifo")
    eng.add_request(req("long", list(range(200, 500)), max_tokens=1))
    assert prefill_tokens(step(eng, runner)) == 256


def test_the_lone_bound_holds_only_while_requests_overlap() -> None:
    """One request at a time has nothing to let in: its prompt takes the whole budget (a
    cut would only cost it time). Once two overlap the bound holds, until
    LONE_BOUND_REQUESTS arrive in a row with no other live."""
    eng, runner = engine(40.0, lone_ms=100.0)

    def solo(i: int) -> int:
        eng.add_request(req(f"solo{i}", list(range(200 + i, 500 + i)), max_tokens=1))
        first = prefill_tokens(step(eng, runner))
        while eng.scheduler.seqs:
            step(eng, runner)
        return first

    assert solo(0) == 256
    overlap(eng, runner)
    firsts = [solo(i) for i in range(1, LONE_BOUND_REQUESTS + 2)]
    # the first LONE_BOUND_REQUESTS - 1 solo arrivals after the overlap keep the bound
    assert firsts == [96] * (LONE_BOUND_REQUESTS - 1) + [256] * 2


def test_the_decode_worker_predicts_the_schedulers_chunk() -> None:
    eng, runner = engine(40.0)
    start_streams(eng, runner, 6)
    limit = eng.scheduler.chunk_limit
    context = sum(s.num_tokens for s in eng.scheduler.running)
    local = WorkerTimes(MODEL, 256, 0, 6, context, 1, 0.0, limit)
    eng.add_request(req("long", list(range(200, 1200)), max_tokens=1))
    assert local.local_chunk(1000, 0) == prefill_tokens(step(eng, runner)) == 24
    # a disagg target equal to the engine's: a local chunk keeps it (no itl_target reason);
    # predicted with the whole budget as the chunk (no engine target), it would not
    cfg = DisaggConfig(enabled=True, max_local_prefill_length=100, max_prefill_queue_size=100,
                       max_prefill_queue_tokens=10**6, itl_weight=0.0, itl_target_ms=40.0)
    slow_queue = (5, 9000)
    assert decide_prefill(cfg, 1000, 0, *slow_queue, local).reason is DecisionReason.LOCAL_FASTER
    unlimited = WorkerTimes(MODEL, 256, 0, 6, context, 1, 0.0)
    assert decide_prefill(cfg, 1000, 0, *slow_queue, unlimited).reason is DecisionReason.ITL_TARGET


def test_the_target_is_off_on_cuda_under_the_auto_step_model() -> None:
    cfg = EngineConfig(itl_target_ms=50.0)
    assert chunk_limit_for(cfg, "cuda:0") is None
    assert isinstance(chunk_limit_for(cfg, "cpu"), ChunkLimit)
    assert isinstance(chunk_limit_for(cfg.model_copy(update={"step_model": "mock"}), "cuda"),
                      ChunkLimit)
    assert chunk_limit_for(EngineConfig(itl_target_ms=None), "cpu") is None
    with pytest.raises(ValueError, match="positive"):
        ChunkLimit.of(MODEL, 0.0, 16)


def test_a_prefix_chunk_costs_its_attention() -> None:
    # deeper chunks read more KV: fewer tokens fit in the same time
    cost = StepCost.of(PROFILE)
    assert cost.slice_tokens(0.05, 0) > cost.slice_tokens(0.05, 2000) > cost.slice_tokens(0.05, 6000)
    assert BatchShape().num_seqs == 0


class _Counting(MockStepModel):
    """MODEL, counting the calls made to it."""

    calls = 0

    def steps_seconds(self, total: BatchShape, steps: int) -> float:
        type(self).calls += 1
        return MockStepModel.steps_seconds(self, total, steps)


def test_the_step_model_is_read_once_at_start_not_per_step() -> None:
    cfg = mock_cfg(block_size=4, num_kv_blocks=512, max_num_seqs=16, max_num_batched_tokens=256,
                   max_model_len=2048).model_copy(update={"itl_target_ms": 40.0})
    runner = MockRunner(cfg)
    eng = LLMEngine(runner, cfg, [EOS], step_model=_Counting(0.004, 0.001, 0.002))
    at_start = _Counting.calls
    assert at_start > 0
    start_streams(eng, runner, 6)
    eng.add_request(req("long", list(range(200, 1200)), max_tokens=1))
    for _ in range(10):
        assert prefill_tokens(step(eng, runner)) == 24
    assert _Counting.calls == at_start  # the budget is arithmetic on hoisted coefficients


def test_device_speed_is_a_bounded_moving_mean_of_measured_over_predicted_for_each_fit() -> None:
    speed = DeviceSpeed()
    for _ in range(400):
        speed.observe(False, 0.040, 0.020)  # decode-only steps run twice as fast as modelled
        speed.observe(True, 0.100, 0.110)  # steps with prefill 10% slower
    assert speed.decode.mean == pytest.approx(0.5, rel=1e-3) and speed.prefill.mean == pytest.approx(1.1, rel=1e-3)
    assert speed.steps == 800
    speed.observe(True, 0.0, 1.0)  # nothing predicted: nothing learnt
    assert speed.steps == 800
    # a step stalled 10,000x counts as twice the mean: settled, it moves the mean by the least
    # weight; as a fit's first step, it weighs as much as the prior
    settled = speed.prefill.mean
    speed.observe(True, 0.010, 100.0)
    assert speed.prefill.mean == pytest.approx(settled + SPEED_WEIGHT * (STEP_SWING - 1) * settled)
    once = DeviceSpeed()
    once.observe(True, 0.010, 100.0)
    assert once.prefill.mean == pytest.approx((1 + STEP_SWING) / 2) and once.decode.mean == 1.0
    once.observe(True, 1.0, 1e-6)  # and 1,000,000x fast counts as half the mean
    assert once.prefill.mean == pytest.approx(1.5 + (1.5 / STEP_SWING - 1.5) / 3)


def test_a_fit_learns_its_speed_within_its_first_steps() -> None:
    """The eager forward beside streams runs a few steps a minute: a fixed small weight left
    its mean most of the way short of the device's speed for minutes."""
    speed = DeviceSpeed()
    for n in range(1, 6):
        speed.observe(True, 0.1, 0.13)
        # a running mean with the prior (1) as one step
        assert speed.prefill.mean == pytest.approx((1 + 1.3 * n) / (n + 1))
    assert speed.prefill.mean > 1.24 and speed.prefill.steps == 5
    assert speed.decode.mean == speed.rows.mean == 1.0 and speed.decode.steps == speed.rows.steps == 0
    for _ in range(200):  # past 1 / SPEED_WEIGHT steps the weight stays at its least
        speed.observe(True, 0.1, 0.13)
    before = speed.prefill.mean
    speed.observe(True, 0.1, 0.10)
    assert speed.prefill.mean == pytest.approx(before + SPEED_WEIGHT * (1.0 - before))


def test_steps_that_scatter_are_planned_above_their_mean() -> None:
    steady, scattered = DeviceSpeed(), DeviceSpeed()
    for i in range(400):
        steady.observe(True, 0.1, 0.1, rows=True)
        scattered.observe(True, 0.1, 0.09 if i % 2 else 0.11, rows=True)
    assert steady.rows.spread == pytest.approx(0.0, abs=1e-6) and steady.rows.plan() == pytest.approx(1.0)
    assert scattered.rows.mean == pytest.approx(1.0, abs=0.01)
    assert scattered.rows.spread == pytest.approx(0.1, abs=0.01)
    assert scattered.rows.plan() == pytest.approx(1.0 + PLAN_SPREADS * scattered.rows.spread, rel=0.02)
    assert scattered.prefill.plan() == scattered.decode.plan() == 1.0  # the other fits untouched
    # a spread past the cap (a machine shared with other work) plans at most that far above
    wild = DeviceSpeed(prefill=FitSpeed(1.2, 0.3))
    assert PLAN_SPREADS * 0.3 > MAX_PLAN_MARGIN
    assert wild.prefill.plan() == pytest.approx(1.2 * (1 + MAX_PLAN_MARGIN))
    # the target's slices share its seconds at the planned ratio: the scattering device fits less
    for fit, kw in (("rows", {"rows": True}), ("prefill", {})):
        a, b = DeviceSpeed(), DeviceSpeed()
        for i in range(400):
            a.observe(True, 0.1, 0.1, **kw)
            b.observe(True, 0.1, 0.08 if i % 2 else 0.12, **kw)
        left_a = ChunkLimit.of(MODEL, 40.0, 4, a).seconds_left(6, 60, rows=fit == "rows")
        left_b = ChunkLimit.of(MODEL, 40.0, 4, b).seconds_left(6, 60, rows=fit == "rows")
        assert left_b < left_a


def test_a_faster_device_fits_more_prefill_under_the_same_target() -> None:
    limit = ChunkLimit.of(MODEL, 40.0, 4)
    twice = ChunkLimit.of(MODEL, 40.0, 4, DeviceSpeed(decode=FitSpeed(1.0), prefill=FitSpeed(0.5)))
    # 6 streams: 16 ms of the model's decodes. 40 ms leave 24 tokens at 1 ms a token; where
    # steps with prefill run twice as fast the 40 real ms are 80 model ms: 64 tokens.
    assert limit.first_chunk(1000, 0, 6, 6 * 10, 256) == 24
    assert twice.first_chunk(1000, 0, 6, 6 * 10, 256) == 64
    # the decode-only ratio does not move a step with prefill, until decode-only steps run
    # fast enough that the split pays: 6 decodes alone at 0.25 x 16 ms = 4 ms against 12 ms
    # beside a prefill; the prefill step alone gets 40 - 4 - its 4 ms base = 32 tokens
    assert ChunkLimit.of(MODEL, 40.0, 4, DeviceSpeed(decode=FitSpeed(0.8))).first_chunk(1000, 0, 6, 60, 256) == 24
    assert ChunkLimit.of(MODEL, 40.0, 4, DeviceSpeed(decode=FitSpeed(0.25))).first_chunk(1000, 0, 6, 60, 256) == 32


class _CpuMock(MockRunner):
    """A mock whose steps count as real time (as a CPU runner's)."""

    info = RunnerInfo(device="cpu")


class _Recording(DeviceSpeed):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[bool, float, float]] = []

    def observe(self, with_prefill: bool, predicted_s: float, measured_s: float,
                rows: bool = False) -> None:
        assert not rows  # the mock has no row path
        self.seen.append((with_prefill, predicted_s, measured_s))


def test_the_engine_feeds_every_step_to_the_speed_where_steps_take_real_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = mock_cfg(block_size=4, num_kv_blocks=512, max_num_seqs=16, max_num_batched_tokens=256,
                   max_model_len=2048).model_copy(update={"itl_target_ms": 40.0})
    assert LLMEngine(MockRunner(cfg), cfg, [EOS], step_model=MODEL).speed is None
    assert LLMEngine(_CpuMock(cfg), cfg.model_copy(update={"itl_target_ms": None}), [EOS],
                     step_model=MODEL).speed is None
    for overlap in (False, True):
        eng = LLMEngine(_CpuMock(cfg), cfg.model_copy(update={"overlap": overlap}), [EOS],
                        step_model=MODEL)
        assert eng.speed is not None and eng.overlap == overlap
        eng.speed = speed = _Recording()
        seen = speed.seen
        ran: list[ScheduledBatch] = []
        execute = eng.runner.execute
        monkeypatch.setattr(eng.runner, "execute", lambda b, ran=ran, ex=execute: (ran.append(b), ex(b))[1])
        eng.add_request(req("a", [100] * 8, max_tokens=5))
        eng.add_request(req("b", list(range(200, 260)), max_tokens=5))
        while eng.has_unfinished():
            eng.step()
        shapes = [batch_shape(b) for b in ran]
        assert [(w, p) for w, p, _ in seen] == [(sh.prefill_tokens > 0, pytest.approx(MODEL.step_seconds(sh)))
                                              for sh in shapes]
        assert len(seen) >= 5 and any(w for w, _, _ in seen) and not all(w for w, _, _ in seen)
        assert all(m > 0 for _, _, m in seen)
        got = eng.stats().step_speed
        assert got == DeviceSpeed(speed.decode, speed.prefill, speed.rows, speed.steps)
        assert got is not speed  # a copy: the step thread goes on moving its own


class _CheapDecodes:
    """A CPU-like device: a prefill step costs 10 ms + 1 ms a token + 2 ms a decode beside
    it; a decode-only step 2 ms + 0.5 ms a sequence (the one-call decode kernel)."""

    reads_decode_context = False
    overlap_pays = True
    row_tokens = 0

    def step_seconds(self, shape: BatchShape) -> float:
        if shape.prefill_tokens:
            return self.steps_seconds(shape, 1)
        return 0.002 + 0.0005 * shape.decode_seqs

    def steps_seconds(self, total: BatchShape, steps: int) -> float:
        return 0.010 * steps + 0.001 * total.prefill_tokens + 0.002 * total.decode_seqs


CHEAP = _CheapDecodes()


def split_engine(target_ms: float, max_num_seqs: int = 16) -> tuple[LLMEngine, MockRunner]:
    cfg = mock_cfg(block_size=4, num_kv_blocks=512, max_num_seqs=max_num_seqs, max_num_batched_tokens=256,
                   max_model_len=2048).model_copy(update={"itl_target_ms": target_ms})
    runner = MockRunner(cfg)
    return LLMEngine(runner, cfg, [EOS], step_model=CHEAP), runner


def test_past_a_few_streams_prefill_runs_alone_then_the_decodes_and_the_pair_keeps_the_target() -> None:
    limit = ChunkLimit.of(CHEAP, 40.0, 4)
    # 1 stream: 2.5 ms alone against 2 ms beside a prefill: mixing pays; 8: 6 ms against 16
    assert not limit.split_pays(1, 0) and limit.split_pays(8, 0)
    eng, runner = split_engine(40.0)
    start_streams(eng, runner, 8)
    eng.add_request(req("long", list(range(200, 600)), max_tokens=1))
    batches = []
    while "long" in eng.scheduler.seqs:
        batches.append(step(eng, runner))
    assert not any(b.num_decodes and prefill_tokens(b) for b in batches)  # never mixed
    alone = [i for i, b in enumerate(batches) if prefill_tokens(b)]
    assert len(alone) == -(-400 // 24) and all(b.num_decodes == 8 for b in batches[alone[0] + 1::2])
    # 40 ms less the 6 ms decode step and the prefill step's 10: 24 tokens a prefill step,
    # and each prefill step with the streams' step after it keeps the target
    assert [prefill_tokens(batches[i]) for i in alone[:-1]] == [24] * (len(alone) - 1)
    for i in alone[:-1]:
        pair = CHEAP.step_seconds(batch_shape(batches[i])) + CHEAP.step_seconds(batch_shape(batches[i + 1]))
        assert pair <= 0.040 + 1e-9


def test_a_prefill_step_with_nothing_to_prefill_runs_the_decodes_instead() -> None:
    eng, runner = split_engine(40.0, max_num_seqs=8)
    start_streams(eng, runner, 8)  # every seat taken: the waiting prompt cannot be admitted
    eng.add_request(req("waits", list(range(200, 260)), max_tokens=1))
    for _ in range(4):
        batch = step(eng, runner)
        assert batch.num_decodes == 8 and prefill_tokens(batch) == 0


def test_the_decode_workers_chunk_is_the_split_steps_where_the_scheduler_splits() -> None:
    limit = ChunkLimit.of(CHEAP, 40.0, 4)
    # 8 streams: a step of prefill alone gets 40 - 6 (their decode step) - 10 (its base) ms
    assert limit.first_chunk(1000, 0, 8, 0, 256) == 24
    # 1 stream mixes: 40 - 10 - 2 ms beside it
    assert limit.first_chunk(1000, 0, 1, 0, 256) == 28


class _RowsMock(MockRunner):
    """A mock with a row path (the CPU's one-call step) for steps of up to 8 prefill tokens."""

    row_step_tokens = 8

    def runs_as_rows(self, batch: ScheduledBatch) -> bool:
        return 0 < prefill_tokens(batch) <= self.row_step_tokens


def test_rows_have_a_speed_of_their_own() -> None:
    speed = DeviceSpeed()
    speed.observe(True, 0.1, 0.05, rows=True)
    assert speed.rows.mean == pytest.approx(0.75) and speed.prefill.mean == 1.0  # the first step weighs 1/2
    speed.observe(True, 0.1, 0.2)
    assert (speed.prefill.mean == pytest.approx(1.5) and speed.decode.mean == 1.0
            and speed.rows.mean == pytest.approx(0.75))


@pytest.mark.parametrize(("target_ms", "rows", "chunk"), [
    (14.0, True, 8),  # the eager step fits 14 - 4 - 2 * 2 = 6 tokens: rows, whose speed 0.5 fits more, capped at 8
    (14.0, False, 6),  # no row path: the eager step's 6
    (20.0, True, 12),  # the eager step fits 12, past the row limit: eager, uncapped
])
def test_a_step_beside_streams_takes_the_row_path_where_the_eager_step_fits_no_more(
        target_ms: float, rows: bool, chunk: int) -> None:
    cfg = mock_cfg(block_size=4, num_kv_blocks=512, max_num_seqs=16, max_num_batched_tokens=256,
                   max_model_len=2048).model_copy(update={"itl_target_ms": target_ms})
    runner = _RowsMock(cfg) if rows else MockRunner(cfg)
    eng = LLMEngine(runner, cfg, [EOS], step_model=MODEL)
    limit = eng.scheduler.chunk_limit
    assert limit is not None and limit.row_tokens == (8 if rows else 0)
    limit.speed.rows.mean = 0.5  # the row steps run at half the model's price
    start_streams(eng, runner, 2)
    eng.add_request(req("long", list(range(200, 400)), max_tokens=1))
    batch = step(eng, runner)
    assert batch.num_decodes == 2 and prefill_tokens(batch) == chunk
    # the decode worker's prediction takes the same chunk
    assert limit.first_chunk(200, 0, 2, 2 * 9, 256) == chunk


# A profile whose row steps cost their own: 1.5 ms a prefill token as rows, 1 ms on the
# eager line (services/steptime/profile.py); 4 ms a step and 2 ms a decode on both.
ROW_PRICED = ProfileStepModel(DecodeCost(base_s=0.004, per_seq_s=0.002),
                              PrefillCost(base_s=0.004, per_token_s=0.001, per_decode_seq_s=0.002),
                              rows=PrefillCost(base_s=0.004, per_token_s=0.0015, per_decode_seq_s=0.002),
                              row_tokens=8)


@pytest.mark.parametrize(("model", "chunk"), [
    (ROW_PRICED, 4),  # the eager line fits 6 tokens (rows, then): the row cost fits 6 / 1.5
    (replace(ROW_PRICED, rows=None, row_tokens=0), 6),  # one line for both: its 6
])
def test_a_row_step_is_priced_at_the_models_row_cost(model: ProfileStepModel, chunk: int) -> None:
    cfg = mock_cfg(block_size=4, num_kv_blocks=512, max_num_seqs=16, max_num_batched_tokens=256,
                   max_model_len=2048).model_copy(update={"itl_target_ms": 14.0})
    runner = _RowsMock(cfg)
    eng = LLMEngine(runner, cfg, [EOS], step_model=model)
    limit = eng.scheduler.chunk_limit
    assert limit is not None
    start_streams(eng, runner, 2)
    eng.add_request(req("long", list(range(200, 400)), max_tokens=1))
    batch = step(eng, runner)
    assert batch.num_decodes == 2 and prefill_tokens(batch) == chunk
    assert model.step_seconds(batch_shape(batch)) <= 0.014 + 1e-12  # the step keeps the target
    assert limit.first_chunk(200, 0, 2, 2 * 9, 256) == chunk  # the decode worker's prediction
    # the engine's speed compares a row step with the row cost: the model's own price
    shape = batch_shape(batch)
    assert StepCost.of(model).shape_seconds(shape, rows=True) == pytest.approx(model.step_seconds(shape))
    longer = BatchShape(prefill_tokens=100, prefill_context=5050, decode_seqs=2)
    assert StepCost.of(model).shape_seconds(longer) == pytest.approx(model.step_seconds(longer))


def test_a_head_that_cannot_get_in_leaves_the_lone_step_to_the_running_prompt() -> None:
    """No seat for the short (max_num_seqs 1): the long prompt keeps its slices, not an
    empty step (hypothesis found that livelock in test_engine's random mixes)."""
    cfg = mock_cfg(block_size=4, num_kv_blocks=512, max_num_seqs=1, max_num_batched_tokens=256,
                   max_model_len=2048).model_copy(update={"itl_target_ms": 40.0,
                                                          "lone_step_target_ms": 100.0})
    runner = MockRunner(cfg)
    eng = LLMEngine(runner, cfg, [EOS], step_model=MODEL)
    overlap(eng, runner)
    eng.add_request(req("long", list(range(200, 500)), max_tokens=1))
    assert prefill_tokens(step(eng, runner)) == 96
    eng.add_request(req("short", list(range(600, 608)), max_tokens=1))
    sizes = []
    while "long" in eng.scheduler.seqs:
        sizes.append({s.request_id: len(s.token_ids) for s in step(eng, runner).seqs})
    assert sizes == [{"long": 96}, {"long": 96}, {"long": 12}]


def test_each_fit_sums_its_steps_as_modelled_and_as_timed() -> None:
    """Unclamped, so the ratio of two readings' differences is the window's own speed."""
    speed = DeviceSpeed()
    speed.observe(False, 0.010, 0.008)
    speed.observe(True, 0.100, 0.150)
    speed.observe(True, 0.040, 0.036, rows=True)
    speed.observe(True, 0.001, 1.0)  # a stall counts in full here, unlike in the mean
    speed.observe(True, 0.0, 1.0)  # nothing predicted: nothing summed either
    assert (speed.decode.model_s, speed.decode.timed_s) == pytest.approx((0.010, 0.008))
    assert (speed.prefill.model_s, speed.prefill.timed_s) == pytest.approx((0.101, 1.150))
    assert (speed.rows.model_s, speed.rows.timed_s) == pytest.approx((0.040, 0.036))
    copy = speed.snapshot()
    speed.observe(False, 0.010, 0.010)
    assert copy.decode.model_s == pytest.approx(0.010) and copy.decode.steps == 1


def test_the_summed_seconds_are_worker_metrics() -> None:
    from prometheus_client import CollectorRegistry

    from services.engine.stats_metrics import EngineStatsCollector
    from services.sim.calibrate import _STEP_SECONDS_METRIC

    cfg = mock_cfg(block_size=4, num_kv_blocks=64).model_copy(update={"itl_target_ms": 40.0})
    eng = LLMEngine(_CpuMock(cfg), cfg, [EOS], step_model=MODEL)
    eng.add_request(req("a", list(range(100, 140)), max_tokens=4))
    while eng.has_unfinished():
        eng.step()
    sp = eng.stats().step_speed
    assert sp is not None and sp.prefill.model_s > 0 and sp.decode.model_s > 0
    reg = CollectorRegistry()
    reg.register(EngineStatsCollector(eng.stats))
    for fit in ("decode", "prefill", "rows"):
        for what in ("modelled", "timed"):
            got = reg.get_sample_value(f"tandem_worker_engine_step_{what}_seconds_total", {"kind": fit})
            assert got == pytest.approx(getattr(sp, fit).model_s if what == "modelled" else getattr(sp, fit).timed_s)
        assert reg.get_sample_value("tandem_worker_engine_step_speed_spread", {"kind": fit}) == pytest.approx(
            getattr(sp, fit).spread)
    from prometheus_client.exposition import generate_latest

    # what `tandem sim calibrate` reads off a worker's /metrics
    found = {(w, f): float(v) for w, f, v in _STEP_SECONDS_METRIC.findall(generate_latest(reg).decode())}
    assert found[("modelled", "prefill")] == pytest.approx(sp.prefill.model_s)
    assert found[("timed", "decode")] == pytest.approx(sp.decode.timed_s)
    assert len(found) == 6
