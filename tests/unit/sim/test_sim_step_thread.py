"""Engine calls wait for the step in flight (the worker's step thread runs them between
steps); the overlapped loop admits a request into the batch after next; prefill workers
take jobs in the order of their pull requests."""

from __future__ import annotations

import pytest

from services.common.config import ClusterConfig, parse_config
from services.disagg.prefill_queue import PULL_WAIT_S
from services.sim import simulator as sim_mod
from services.sim.requests import SimRequest
from services.sim.simulator import Simulation, simulate
from services.steptime.model import MockStepModel

STEP = 0.01  # every step takes 10 ms: MockStepModel(STEP, 0, 0)


def config(*overrides: str) -> ClusterConfig:
    return parse_config({}, ["engine.runner=mock", "engine.num_kv_blocks=256",
                             "decode.replicas=1", "prefill.replicas=0", *overrides])


def prompt(seed: int, n: int) -> tuple[int, ...]:
    return tuple(1000 + (seed * 7919 + i * 104729) % 28000 for i in range(n))


@pytest.mark.parametrize("fast_forward", [True, False], ids=["ff", "single"])
@pytest.mark.parametrize("overlap,ttft", [("false", 0.015), ("true", 0.025)],
                         ids=["serial", "overlapped"])
def test_a_request_reaching_a_busy_worker_waits_for_its_step(overlap: str, ttft: float,
                                                              fast_forward: bool) -> None:
    # A decodes in 10 ms steps from t=0; B arrives mid-step at 15 ms. Serial: B joins the
    # step at 20 ms (first token at 30 ms). Overlapped: the step at 20 ms was scheduled
    # when the one before launched, so B joins the one at 30 ms (first token at 40 ms).
    reqs = [SimRequest(0, 0.0, 32, 20, prompt=prompt(0, 32)),
            SimRequest(1, 0.015, 32, 4, prompt=prompt(1, 32))]
    result = simulate(config(f"engine.overlap={overlap}"), reqs, MockStepModel(STEP, 0, 0),
                      lambda r: list(r.prompt or ()), fast_forward=fast_forward)
    a, b = result.records
    assert a.ttft_s == pytest.approx(STEP)
    assert b.ttft_s == pytest.approx(ttft)
    assert a.completed and b.completed


def test_an_idle_worker_runs_a_call_at_once() -> None:
    reqs = [SimRequest(0, 0.5, 32, 3, prompt=prompt(0, 32))]
    result = simulate(config("engine.overlap=true"), reqs, MockStepModel(STEP, 0, 0),
                      lambda r: list(r.prompt or ()))
    assert result.records[0].ttft_s == pytest.approx(STEP)


def test_the_remote_prefill_decision_and_its_job_are_two_calls(monkeypatch) -> None:
    # The decode worker is busy decoding A (10 ms steps) when long prompt B arrives at
    # 15 ms: its prefix lookup runs when that step ends (20 ms), begin_remote_prefill
    # when the next one does (30 ms; the step thread went on stepping meanwhile), then
    # the job is published.
    published: list[float] = []
    sim: list[Simulation] = []
    real_publish = sim_mod._PrefillQueue.publish

    def spy(self, job):  # type: ignore[no-untyped-def]
        published.append(sim[0].now)
        real_publish(self, job)

    monkeypatch.setattr(sim_mod._PrefillQueue, "publish", spy)
    cfg = config("engine.overlap=false", "prefill.replicas=1",
                 "decode.disagg.max_local_prefill_length=64", "decode.disagg.policy=threshold")
    reqs = [SimRequest(0, 0.0, 32, 20, prompt=prompt(0, 32)),
            SimRequest(1, 0.015, 200, 2, prompt=prompt(1, 200))]
    s = Simulation(cfg, reqs, MockStepModel(STEP, 0, 0), lambda r: list(r.prompt or ()))
    sim.append(s)
    result = s.run()
    assert published == [pytest.approx(0.03)]
    assert result.records[1].remote and result.records[1].completed


@pytest.mark.parametrize("extra", [("decode.disagg.itl_weight=1",), ("decode.disagg.itl_weight=0",)],
                         ids=["remote", "local"])
def test_decisions_of_a_burst_see_the_ones_before_them(monkeypatch, extra: tuple[str, ...]) -> None:
    # B, C and D arrive together while A decodes: their decisions are taken at one step's
    # end and their publishes or adds a step later. Each decision must count the tokens the
    # ones before it sent (queued remotely, or pending here), or a burst goes all one way.
    seen: list[int] = []
    real = sim_mod.decide_prefill

    def spy(cfg, n, cached, depth, queued, times=None):  # type: ignore[no-untyped-def]
        seen.append(queued + (times.pending_prefill_tokens if times else 0))
        return real(cfg, n, cached, depth, queued, times)

    monkeypatch.setattr(sim_mod, "decide_prefill", spy)
    cfg = config("engine.overlap=false", "prefill.replicas=1",
                 "decode.disagg.max_local_prefill_length=64", *extra)
    reqs = [SimRequest(0, 0.0, 32, 20, prompt=prompt(0, 32)),
            *(SimRequest(i, 0.015, 200, 2, prompt=prompt(i, 200)) for i in (1, 2, 3))]
    sim = Simulation(cfg, reqs, MockStepModel(STEP, 0, 0), lambda r: list(r.prompt or ()))
    result = sim.run()
    assert seen == [0, 200, 400]
    assert all(r.completed for r in result.records)
    assert sim.queue is not None and not any(sim.queue.tokens.values())  # all given back
    assert not any(w.adding for w in sim.decoders)


def test_prefill_workers_take_jobs_in_the_order_of_their_pull_requests() -> None:
    cfg = config("prefill.replicas=3", "decode.disagg.max_local_prefill_length=64")
    s = Simulation(cfg, [], MockStepModel(STEP, 0, 0), lambda r: list(r.prompt or ()))
    p0, p1, p2 = s.prefillers
    s.now = 10.25
    # p0 pulled again at 10.2 (after a job); p1 at 9.9, its request renewed at 10.9 is
    # not due yet; p2 at 8.3: renewed at 9.3 and 10.3... 10.3 > now, so 9.3: the oldest.
    p0.pull_at, p1.pull_at, p2.pull_at = 10.2, 9.9, 8.3
    assert PULL_WAIT_S == 1.0
    assert s._puller() is p2
    p2.free_slots = 0
    assert s._puller() is p1  # issued at 9.9, before p0's 10.2
    p1.free_slots = 0
    assert s._puller() is p0
    p0.free_slots = 0
    assert s._puller() is None
