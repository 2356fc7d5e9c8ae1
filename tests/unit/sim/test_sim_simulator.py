"""The simulator: deterministic, fast-forwarded runs equal step-by-step ones, production
classes inside, remote prefill through the queue, nothing leaked."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from services.common.config import ClusterConfig, parse_config
from services.decode import disagg
from services.engine.block_pool import BlockPool
from services.engine.kv_cache_manager import KvCacheManager
from services.engine.scheduler import Scheduler
from services.router.indexer import RadixIndex
from services.router.load import LoadTracker
from services.router.router import Router
from services.sim import simulator as sim_mod
from services.sim.records import RequestRecord, SimResult
from services.sim.requests import SimRequest
from services.sim.simulator import Simulation, simulate
from services.steptime.model import MockStepModel


def workload(n: int = 120, rate: float = 6.0, seed: int = 0, turns: bool = False) -> list[SimRequest]:
    """Short and long prompts over 4 shared system prompts, Poisson arrivals; with ``turns``
    every third request is the next turn of the one before it (sent when it ends)."""
    rng = np.random.default_rng(seed)
    systems = [tuple(int(x) for x in rng.integers(1000, 30000, 48)) for _ in range(4)]
    t = 0.0
    out = []
    for i in range(n):
        t += float(rng.exponential(1 / rate))
        own = tuple(int(x) for x in rng.integers(1000, 30000, int(rng.choice([20, 400]))))
        prompt = systems[i % 4] + own
        after = i - 1 if turns and i % 3 == 2 else None
        out.append(SimRequest(i, t, len(prompt), int(rng.integers(2, 40)), prompt=prompt,
                              after=after))
    return out


def config(*overrides: str) -> ClusterConfig:
    return parse_config({}, ["engine.runner=mock", "engine.num_kv_blocks=512",
                             "engine.mock.step_base_s=0.004",
                             "engine.mock.per_prefill_token_s=0.0002",
                             "engine.mock.per_decode_seq_s=0.0005", *overrides])


def run(cfg: ClusterConfig, reqs: list[SimRequest], fast_forward: bool = True) -> SimResult:
    return simulate(cfg, reqs, MockStepModel.of(cfg.engine.mock), lambda r: list(r.prompt),
                    fast_forward=fast_forward)


def timings(result: SimResult) -> list[tuple]:
    return [(r.index, r.worker, r.prefill_worker, r.remote, r.cached_tokens, r.first_token_s,
             r.end_s, r.tokens_out, r.completed, r.error) for r in result.records]


AGG = ("decode.replicas=3", "prefill.replicas=0")
DISAGG = ("decode.replicas=2", "prefill.replicas=2", "decode.disagg.max_local_prefill_length=128")


@pytest.mark.parametrize("layout", [AGG, DISAGG], ids=["agg", "disagg"])
def test_same_trace_and_seed_give_the_same_run(layout: tuple[str, ...]) -> None:
    a = run(config(*layout), workload())
    b = run(config(*layout), workload())
    assert timings(a) == timings(b)
    assert (a.gaps.values, a.gaps.counts) == (b.gaps.values, b.gaps.counts)


@pytest.mark.parametrize("layout", [AGG, DISAGG, (*AGG, "sim.request_overhead_s=0.01"),
                                    (*AGG, "engine.overlap=false"),
                                    (*DISAGG, "engine.overlap=false"),
                                    (*AGG, "sim.load_interval_s=0.013")],
                         ids=["agg", "disagg", "overhead", "serial", "disagg-serial",
                              "dense-ticks"])
@pytest.mark.parametrize("turns", [False, True], ids=["open", "turns"])
def test_fast_forwarded_decode_gives_the_timings_of_single_steps(layout: tuple[str, ...],
                                                                 turns: bool) -> None:
    cfg = config(*layout)
    reqs = workload(turns=turns)
    fast = run(cfg, reqs, fast_forward=True)
    slow = run(cfg, reqs, fast_forward=False)
    if not turns:  # (a request waiting for another's end stops every run at the next step)
        assert fast.fast_forward_steps > fast.steps  # the fast path did most of the work
    assert slow.fast_forward_steps == 0
    assert timings(fast) == timings(slow)
    assert fast.steps + fast.fast_forward_steps == slow.steps
    expand = lambda r: sorted(np.repeat(r.gaps.values, r.gaps.counts).tolist())  # noqa: E731
    assert expand(fast) == expand(slow)
    assert [w.busy_s for w in fast.workers] == [w.busy_s for w in slow.workers]
    # every load sample the router saw, ticks inside fast-forwarded runs included
    assert fast.worker_samples == slow.worker_samples
    assert all(r.completed for r in fast.records)


def test_the_objects_inside_are_the_production_classes() -> None:
    s = Simulation(config(*DISAGG), workload(10), MockStepModel(0.001, 0, 0),
                   lambda r: list(r.prompt))
    assert type(s.router) is Router
    assert type(s.router.index) is RadixIndex
    assert type(s.router.load) is LoadTracker
    for w in s.decoders + s.prefillers:
        assert type(w.engine.scheduler) is Scheduler
        assert type(w.engine.kv) is KvCacheManager
        assert type(w.engine.pool) is BlockPool
    assert sim_mod.decide_prefill is disagg.decide_prefill


def test_a_disaggregated_run_prefills_remotely_through_the_queue(monkeypatch) -> None:
    depths: list[int] = []
    real = disagg.decide_prefill

    def spy(cfg, prompt_len, cached, depth, queued, times=None):  # type: ignore[no-untyped-def]
        depths.append(depth)
        return real(cfg, prompt_len, cached, depth, queued, times)

    monkeypatch.setattr(sim_mod, "decide_prefill", spy)
    cfg = config(*DISAGG, "decode.disagg.max_prefill_queue_size=2", "prefill.max_concurrent_jobs=1",
                 "decode.disagg.policy=threshold")
    s = Simulation(cfg, workload(rate=12.0), MockStepModel.of(cfg.engine.mock),
                   lambda r: list(r.prompt))
    result = s.run()
    remote = [r for r in result.records if r.remote]
    assert remote and len(remote) < len(result.records)
    assert all(r.prefill_worker.startswith("prefill-") for r in remote)
    assert all(r.completed and r.tokens_out == r.output_tokens for r in result.records)
    assert max(depths) >= 2  # the queue filled, and the rule saw it
    assert {r.prefill_worker for r in remote} == {"prefill-0", "prefill-1"}
    # nothing leaked: every block back in the pools, the queue empty, the router's load zero
    for w in s.decoders + s.prefillers:
        assert w.engine.pool.num_used == 0 and not w.engine.has_unfinished()
        w.engine.check_integrity()
    assert s.queue is not None and s.queue.depth() == 0 and not any(s.queue.tokens.values())
    assert s.router.load.inflight_count() == 0
    s.router.index.check_integrity()


def test_the_router_index_follows_the_engines_caches() -> None:
    s = Simulation(config(*AGG), workload(60), MockStepModel(0.002, 0.0001, 0.0002),
                   lambda r: list(r.prompt))
    s.run()
    for w in s.decoders:
        held = {h.seq_hash for h in (w.engine.pool.block_hash(b) for b in range(
            w.engine.pool.num_blocks)) if h is not None}
        assert s.router.index.num_blocks(w.id) == len(held)
        assert all(s.router.index.holds(w.id, h) for h in held)


def test_a_prompt_too_long_for_the_cache_fails_alone() -> None:
    reqs = workload(20)
    long = dataclasses.replace(reqs[5], prompt=tuple(range(1000, 1000 + 2000)), input_len=2000)
    reqs[5] = long
    result = run(config(*AGG, "engine.num_kv_blocks=64"), reqs)
    bad = result.records[5]
    assert not bad.completed and bad.error and "never fit" in bad.error
    assert all(r.completed for r in result.records if r.index != 5)


def test_records_are_consistent() -> None:
    result = run(config(*AGG), workload())
    for r in result.records:
        assert isinstance(r, RequestRecord)
        assert r.sent_s <= r.first_token_s <= r.end_s
        assert r.tokens_out == r.output_tokens
    assert result.duration_s >= max(r.end_s for r in result.records) - 1e-9


def test_the_overlapped_loop_composes_one_batch_ahead() -> None:
    reqs = workload(60)
    on = Simulation(config(*AGG), reqs, MockStepModel(0.02, 0.0002, 0.0005), lambda r: list(r.prompt))
    off = Simulation(config(*AGG, "engine.overlap=false"), reqs, MockStepModel(0.02, 0.0002, 0.0005),
                     lambda r: list(r.prompt))
    assert (on.depth, off.depth) == (2, 1)
    a, b = on.run(), off.run()
    # a request arriving while a batch computes waits for the one composed beside it
    ttft = lambda r: np.mean([x.ttft_s for x in r.records])  # noqa: E731
    assert ttft(a) > ttft(b)
    assert all(x.completed for x in a.records + b.records)
