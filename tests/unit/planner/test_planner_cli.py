from __future__ import annotations

import pytest

from services.cli import build_parser, main
from services.common.config import ClusterConfig, parse_config
from services.planner.formula import FormulaPolicy
from services.planner.lookahead import SimulatePolicy
from services.planner.serve import PlannerSetupError, build_policy
from tests.support.planner_fakes import OneMoreDecode


def test_tandem_planner_parses_like_a_part() -> None:
    args = build_parser().parse_args(["planner", "-c", "x.yaml", "--set", "planner.enabled=true"])
    assert args._key == ("planner",) and args.config == "x.yaml"


def test_a_policy_from_outside_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_PLANNER_POLICY", "tests.support.planner_fakes:one_more_decode")
    assert isinstance(build_policy(ClusterConfig()), OneMoreDecode)


def test_the_built_in_policies(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TANDEM_PLANNER_POLICY", raising=False)
    assert isinstance(build_policy(ClusterConfig()), SimulatePolicy)  # the default
    formula = parse_config({}, ["planner.policy=formula", "engine.runner=mock"])
    assert isinstance(build_policy(formula), FormulaPolicy)


def test_a_policy_that_cannot_be_had_stops_it_at_once_saying_why(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TANDEM_PLANNER_POLICY", "tests.support.planner_fakes:no_such_policy")
    with pytest.raises(PlannerSetupError, match="no_such_policy"):
        build_policy(ClusterConfig())
    # before any NATS connection: there is no nats-server on this URL
    assert main(["planner", "--set", "nats.url=nats://127.0.0.1:1"]) == 2
    assert "tandem planner: TANDEM_PLANNER_POLICY=tests.support.planner_fakes:no_such_policy" in (
        capsys.readouterr().err)
