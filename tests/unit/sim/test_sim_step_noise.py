"""Steps that scatter around their model (sim.step_noise): seeded, mean 1, learnt by the
simulated engine as a real one learns its speed, and seen by its remote-prefill decision."""

from __future__ import annotations

import argparse
import math
import statistics

import pytest

from services.common.config import ClusterConfig
from services.decode import disagg
from services.sim import simulator as simmod
from services.sim.calibrate import step_noise
from services.sim.calibrate_args import step_noise_arg
from services.sim.requests import SimRequest
from services.sim.simulator import Simulation, _StepNoise
from services.steptime.model import MockStepModel
from services.steptime.profile import FitError
from tests.unit.sim.test_sim_host_share import lone
from tests.unit.sim.test_sim_simulator import AGG, DISAGG, config, workload

MODEL = MockStepModel(0.004, 0.0002, 0.0005)
ONE = ("decode.replicas=1", "prefill.replicas=0")


def sim(cfg: ClusterConfig, reqs: list[SimRequest], fast_forward: bool = True) -> Simulation:
    return Simulation(cfg, reqs, MODEL, lambda r: list(r.prompt), fast_forward=fast_forward)


def busy(s: Simulation) -> float:
    return sum(w.totals.busy_s for w in s.decoders + s.prefillers)


def test_the_factors_have_mean_one_and_the_spread_asked() -> None:
    noise = _StepNoise(0.1, 3)
    xs = [noise.next() for _ in range(20_000)]
    assert statistics.fmean(xs) == pytest.approx(1.0, abs=0.005)
    assert statistics.pstdev(xs) == pytest.approx(0.1, rel=0.05)
    again = _StepNoise(0.1, 3)
    assert [again.next() for _ in range(100)] == xs[:100]


def test_no_noise_is_the_model_exactly() -> None:
    reqs = workload(40)
    assert (sim(config(*AGG, "sim.step_noise=0"), reqs).run().records
            == sim(config(*AGG), reqs).run().records)


def test_noisy_steps_are_seeded_and_keep_the_models_mean() -> None:
    reqs = [SimRequest(0, 0.0, 40, 2000, prompt=tuple(range(40)))]  # one long decode run
    plain = sim(config(*ONE), reqs)
    plain.run()
    runs = []
    for seed in (0, 0, 1):
        s = sim(config(*ONE, "sim.step_noise=0.2", f"sim.seed={seed}"), reqs)
        runs.append((s.run().records, busy(s)))
    assert runs[0] == runs[1]
    assert runs[0][0] != runs[2][0]
    for _, seconds in runs:
        assert seconds != busy(plain)
        assert seconds == pytest.approx(busy(plain), rel=0.03)  # 2,000 steps of sd 0.2


def test_fast_forwarded_runs_scatter_as_single_steps_do() -> None:
    reqs = workload(60, rate=10.0)
    cfg = config(*AGG, "sim.step_noise=0.15")
    ff, single, plain = sim(cfg, reqs), sim(cfg, reqs, fast_forward=False), sim(config(*AGG), reqs)
    for s in (ff, single, plain):
        s.run()
    # the draws fall on other steps; neither moves the busy time off the model's
    assert busy(ff) != busy(plain) and busy(single) != busy(plain)
    assert busy(ff) == pytest.approx(busy(plain), rel=0.05)
    assert busy(single) == pytest.approx(busy(plain), rel=0.05)


def test_the_engine_learns_the_scatter_under_an_itl_target() -> None:
    s = sim(config(*ONE, "engine.itl_target_ms=100", "sim.step_noise=0.1"), lone())
    s.run()
    speed = s.decoders[0].engine.scheduler.chunk_limit.speed
    assert speed.decode.mean == pytest.approx(1.0, abs=0.05)
    assert 0.05 < speed.decode.spread < 0.15
    assert speed.decode.plan() > 1.1  # a target plans its chunks above the mean


def test_the_decision_sees_what_the_engine_learnt(monkeypatch) -> None:
    seen: list[float] = []
    real = disagg.worker_times

    def spy(cfg, model, stats, *a, **k):
        seen.append(stats.step_speed.decode.spread if stats.step_speed is not None else -1.0)
        return real(cfg, model, stats, *a, **k)

    monkeypatch.setattr(simmod, "worker_times", spy)
    long = [SimRequest(i, 0.5 * i, 400, 30, prompt=tuple(range(10_000 * i, 10_000 * i + 400)))
            for i in range(12)]
    sim(config(*DISAGG, "engine.itl_target_ms=100", "sim.step_noise=0.1"), long).run()
    assert seen and seen[0] == 0.0  # nothing stepped before the first decision
    assert max(seen) > 0.03  # later ones carry the scatter the decode steps taught
    seen.clear()
    sim(config(*DISAGG, "engine.itl_target_ms=100"), long).run()
    assert seen and max(seen) == 0.0  # steps at their model's time teach no scatter


def test_calibrate_takes_the_profiles_fit_error_as_the_noise() -> None:
    from dataclasses import replace

    from services.steptime.profile import SHIPPED_CPU_PROFILE, ProfileStepModel

    prof = ProfileStepModel.load(SHIPPED_CPU_PROFILE)
    prof = replace(prof, error=FitError(0.08, 0.3))
    assert step_noise("auto", "torch", prof) == pytest.approx(0.08 * math.sqrt(math.pi / 2))
    assert step_noise("auto", "mock", prof) == 0.0  # the mock runner's steps take its time exactly
    assert step_noise("auto", "torch", MODEL) == 0.0
    assert step_noise("0.05", "torch", prof) == 0.05


@pytest.mark.parametrize("bad", ["-0.1", "2", "some"])
def test_step_noise_is_auto_or_a_spread(bad: str) -> None:
    assert step_noise_arg("auto") == "auto" and step_noise_arg("0.1") == "0.1"
    with pytest.raises(argparse.ArgumentTypeError):
        step_noise_arg(bad)
