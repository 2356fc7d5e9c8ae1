"""The planner in the simulator: a deterministic run on a shifting load that moves the split
toward prefill when prompts grow, loses no request or token, leaks no KV block; the signals
the policy reads; the sim actuator's join and leave."""

from __future__ import annotations

from pathlib import Path

from services.common.config import ClusterConfig
from services.planner.decision import Split
from services.planner.policies import policy_for
from services.planner.signals import Role
from services.sim.actuator import SimActuator
from services.sim.cluster_signals import SignalReader
from services.sim.planned import PlannedResult, run_planned
from services.sim.planner_eval import eval_config
from services.sim.shifting import Phase, shifting
from services.sim.simulator import Simulation, run_sync
from services.sim.traces import PromptMaker
from services.steptime.profile import step_model_for

PHASES = [Phase(40.0, 1.2, 360, 400), Phase(40.0, 2.0, 700, 40)]


def config(p: int = 2, d: int = 2) -> ClusterConfig:
    return eval_config("configs/disagg.yaml", ["planner.interval_s=5", "planner.cooldown_s=5", "planner.scale_down_window_s=10",
                                               "planner.worker_ready_s=3"], 4, p, d)


def planned(policy: bool = True) -> PlannedResult:
    cfg = config()
    model = step_model_for(cfg)
    return run_planned(cfg, shifting(PHASES, seed=3), model, PromptMaker(0).tokens,
                       policy_for(cfg, model) if policy else None)


def test_planned_run_is_deterministic_and_loses_nothing() -> None:
    a, b = planned(), planned()
    rows = [(r.t, r.prefill, r.decode, r.reason) for r in a.timeline]
    assert rows == [(r.t, r.prefill, r.decode, r.reason) for r in b.timeline]
    assert [(r.first_token_s, r.end_s) for r in a.result.records] == [
        (r.first_token_s, r.end_s) for r in b.result.records]
    recs = a.result.records
    assert all(r.completed and r.error is None and r.tokens_out == r.output_tokens
               for r in recs)
    assert a.leaked_blocks == 0
    assert a.started and a.drained  # the split moved both ways
    # prompts grow at 40 s: by its end prefill has more workers than at its start
    early = max(r.prefill for r in a.timeline if r.t <= 40)
    late = max(r.prefill for r in a.timeline if 45 <= r.t <= 80)
    assert late > early
    assert all(r.goodput is None or 0.0 <= r.goodput <= 1.0 for r in a.timeline)


def test_fixed_run_records_the_same_timeline_shape() -> None:
    pr = planned(policy=False)
    assert pr.decisions == [] and pr.started == pr.drained == 0
    assert {(r.prefill, r.decode, r.action) for r in pr.timeline} == {(2, 2, "fixed")}


def test_signals_and_actuator_on_a_running_simulation() -> None:
    cfg = config(1, 2)
    sim = Simulation(cfg, shifting(PHASES, seed=1), step_model_for(cfg), PromptMaker(0).tokens)
    reader = SignalReader(sim)
    act = SimActuator(sim, worker_ready_s=2.0)
    seen = []

    def at_10() -> None:
        s = reader.read()
        seen.append(s)
        assert s.count(Role.PREFILL) == 1 and s.count(Role.DECODE) == 2
        assert s.last.arrivals > 0 and s.last.duration_s == 10.0
        assert s.last.mean_input_tokens > 256
        run_sync(act.apply(Split(2, 1)))
        assert run_sync(act.current()) == Split(2, 1)

    def at_11() -> None:
        s = reader.read()
        starting = [w for w in s.workers if not w.ready]
        assert {w.role for w in starting} >= {Role.PREFILL}
        assert s.count(Role.DECODE, ready_only=True) == 1

    sim.at(10.0, at_10)
    sim.at(11.0, at_11)
    sim.at(15.0, lambda: seen.append(reader.read()))
    res = sim.run()
    assert len(seen) == 2
    assert seen[1].count(Role.PREFILL, ready_only=True) == 2
    assert all(r.completed and r.tokens_out == r.output_tokens for r in res.records)
    assert sim.leaked_blocks == 0 and act.started == 1 and act.drained == 1


def test_planner_eval_only_planner_runs_the_policy_alone(tmp_path: Path) -> None:
    """`tandem sim planner-eval --only planner`: a policy's iteration, no fixed splits, no
    verdict, no plots."""
    import argparse

    from services.sim.planner_eval import evaluate

    args = argparse.Namespace(config="configs/disagg.yaml", overrides=["planner.interval_s=5"],
                              phase_s=10.0, seed=0, only="planner", time_scale=1.0)
    result = evaluate(args, 2, tmp_path)
    assert [r["run"] for r in result["runs"]] == ["planner"]
    assert result["verdict"] is None and "planner" in result["runs"][0]
    assert list(tmp_path.iterdir()) == []


def test_time_scale_stretches_the_device_the_targets_and_the_periods_not_the_start_up() -> None:
    from services.common.config import load_config
    from services.sim.planner_eval import EVAL_SETTINGS, time_scale_settings

    base = load_config("configs/disagg.yaml", list(EVAL_SETTINGS))
    assert time_scale_settings(base, 1.0) == []
    cfg = load_config("configs/disagg.yaml", [*EVAL_SETTINGS, *time_scale_settings(base, 2.5)])
    m, m0 = cfg.engine.mock, base.engine.mock
    assert (m.step_base_s, m.per_prefill_token_s, m.per_decode_seq_s) == (
        2.5 * m0.step_base_s, 2.5 * m0.per_prefill_token_s, 2.5 * m0.per_decode_seq_s)
    pl, pl0 = cfg.planner, base.planner
    for key in ("ttft_p90_s", "itl_p90_s", "interval_s", "cooldown_s", "scale_down_window_s"):
        assert getattr(pl, key) == 2.5 * getattr(pl0, key), key
    assert cfg.engine.itl_target_ms == 2.5 * base.engine.itl_target_ms
    assert cfg.engine.lone_step_target_ms == 2.5 * base.engine.lone_step_target_ms
    assert pl.worker_ready_s == pl0.worker_ready_s  # a process start is real time


def test_a_fixed_split_meets_the_same_targets_at_any_time_scale(tmp_path: Path) -> None:
    """The device K times slower, the load K times sparser and the targets K times looser:
    the same requests, and the same ones within the targets (what benchmarks/planner_live.py
    relies on to run the workload with less CPU per device second)."""
    import argparse

    from services.sim.planner_eval import evaluate

    def fixed(k: float) -> dict:
        args = argparse.Namespace(config="configs/disagg.yaml", overrides=["planner.interval_s=5"],
                                  phase_s=15.0, seed=1, only=None, time_scale=k)
        out = tmp_path / f"k{k}"
        out.mkdir()
        result = evaluate(args, 2, out)
        return next(r for r in result["runs"] if r["run"] == "fixed 1p1d")

    a, b = fixed(1.0), fixed(2.0)
    assert a["requests"] == b["requests"] > 0
    # a value given on the command line is scaled too
    assert [t["t"] for t in b["timeline"][:2]] == [10.0, 20.0]
    assert b["duration_s"] > 1.8 * a["duration_s"]
    assert 0.0 < a["goodput_fraction"] < 1.0  # a figure the scale could move
    assert abs(a["goodput_fraction"] - b["goodput_fraction"]) <= 0.05
