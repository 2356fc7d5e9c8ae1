"""Workers sharing a host's CPUs (sim.host_cpus, sim.host_background): a step composed
while others step runs slower, by the runnable threads over the CPUs, and the simulated
engine learns that speed as a real one does under its ITL target."""

from __future__ import annotations

import argparse

import pytest

from services.common.config import ClusterConfig
from services.sim.calibrate import Overheads, busy_cpus, host_share, sim_config
from services.sim.calibrate_args import host_cpus_arg
from services.sim.calibrate_workloads import SCALE_MOCK, build
from services.sim.records import SimResult
from services.sim.requests import SimRequest
from services.sim.simulator import Simulation
from services.steptime.model import MockStepModel
from tests.unit.sim.test_sim_simulator import AGG, config, workload

MODEL = MockStepModel(0.004, 0.0002, 0.0005)


def lone(n: int = 3) -> list[SimRequest]:
    """Requests far apart: one worker steps at a time."""
    return [SimRequest(i, 10.0 * i, 40, 20, prompt=tuple(range(1000 + 50 * i, 1040 + 50 * i)))
            for i in range(n)]


def sim(cfg: ClusterConfig, reqs: list[SimRequest], fast_forward: bool = True) -> Simulation:
    return Simulation(cfg, reqs, MODEL, lambda r: list(r.prompt), fast_forward=fast_forward)


def latencies(r: SimResult) -> list[tuple[float, float]]:
    return [(x.ttft_s, x.end_s - x.first_token_s) for x in r.records]


def test_enough_cpus_change_nothing() -> None:
    reqs = workload(60)
    base = sim(config(*AGG), reqs).run()
    # 3 one-thread workers on 3 CPUs: never more runnable threads than CPUs
    shared = sim(config(*AGG, "sim.host_cpus=3"), reqs).run()
    assert latencies(shared) == latencies(base)


@pytest.mark.parametrize("sharing", [("sim.host_cpus=0.5",),
                                     ("sim.host_cpus=2", "sim.host_background=3")],
                         ids=["half-a-cpu", "background"])
def test_a_lone_worker_on_a_crowded_host_steps_at_its_share(sharing: tuple[str, ...]) -> None:
    base = sim(config("decode.replicas=1", "prefill.replicas=0"), lone()).run()
    shared = sim(config("decode.replicas=1", "prefill.replicas=0", *sharing), lone()).run()
    # (1 engine thread + background) / CPUs = 2 in both: every step twice its model's time
    for (t0, d0), (t1, d1) in zip(latencies(base), latencies(shared), strict=True):
        assert t1 == pytest.approx(2 * t0, rel=1e-6)
        assert d1 == pytest.approx(2 * d0, rel=1e-6)


def test_workers_slow_each_other_only_while_both_step() -> None:
    reqs = workload(80, rate=12.0)
    alone = sim(config(*AGG), lone()).run()
    alone_shared = sim(config(*AGG, "sim.host_cpus=1"), lone()).run()
    assert latencies(alone_shared) == latencies(alone)  # one worker at a time: its own CPU
    busy = sim(config(*AGG), reqs).run()
    busy_shared = sim(config(*AGG, "sim.host_cpus=1"), reqs).run()
    mean = lambda r: sum(x.end_s - x.sent_s for x in r.records) / len(r.records)  # noqa: E731
    assert mean(busy_shared) > 1.2 * mean(busy)
    assert all(x.completed for x in busy_shared.records)


def test_fast_forwarded_runs_share_as_single_steps_do() -> None:
    reqs = workload(80, rate=12.0)
    cfg = config(*AGG, "sim.host_cpus=1.5", "sim.host_background=0.5")
    ff, single = sim(cfg, reqs).run(), sim(cfg, reqs, fast_forward=False).run()
    for a, b in zip(latencies(ff), latencies(single), strict=True):
        assert a == pytest.approx(b, rel=1e-6, abs=1e-9)


def test_the_engine_learns_its_shared_speed_under_an_itl_target() -> None:
    s = sim(config("decode.replicas=1", "prefill.replicas=0", "engine.itl_target_ms=100",
                   "sim.host_cpus=0.5"), lone())
    s.run()
    limit = s.decoders[0].engine.scheduler.chunk_limit
    assert limit is not None
    assert limit.speed.decode.mean == pytest.approx(2.0, rel=0.01)
    plain = sim(config("decode.replicas=1", "prefill.replicas=0", "engine.itl_target_ms=100"), lone())
    plain.run()
    assert plain.decoders[0].engine.scheduler.chunk_limit.speed.decode.mean == pytest.approx(1.0)


def test_calibrate_shares_the_machines_cpus_with_what_ran_before_it() -> None:
    assert host_share("auto", "mock") == (0.0, 0.0)  # the mock runner's steps sleep
    assert host_share("1.5", "torch") == (1.5, 0.0)
    cpus, background = host_share("auto", "torch")
    assert cpus >= 1 and 0.0 <= background <= cpus
    assert 0.0 <= busy_cpus(0.2) <= cpus
    cal = build("long-disagg", 5, False, None, None, None, 24, 0)
    cfg = sim_config(cal, SCALE_MOCK, Overheads(0.0, None, [], []), 2.0, 0.75)
    assert (cfg.sim.host_cpus, cfg.sim.host_background) == (2.0, 0.75)


def test_without_proc_stat_the_background_is_unknown(monkeypatch) -> None:
    from services.sim import calibrate

    def no_stat(seconds: float = 0.0) -> float:
        raise FileNotFoundError("/proc/stat")

    monkeypatch.setattr(calibrate, "busy_cpus", no_stat)
    cpus, background = host_share("auto", "torch")
    assert cpus >= 1 and background is None
    assert host_share("auto", "mock") == (0.0, 0.0)


@pytest.mark.parametrize("bad", ["-1", "many"])
def test_host_cpus_is_auto_or_a_count(bad: str) -> None:
    assert host_cpus_arg("auto") == "auto" and host_cpus_arg("1.5") == "1.5"
    with pytest.raises(argparse.ArgumentTypeError):
        host_cpus_arg(bad)
