"""The policy ``planner.policy`` names, built for a cluster config."""

from __future__ import annotations

from services.common.config import ClusterConfig
from services.planner.capacity import Capacity
from services.planner.formula import FormulaPolicy
from services.planner.lookahead import SimulatePolicy
from services.planner.policy import Policy
from services.steptime.model import StepModel


def policy_for(cfg: ClusterConfig, model: StepModel) -> Policy:
    cap = Capacity.of(cfg, model)
    if cfg.planner.policy == "formula":
        return FormulaPolicy(cfg.planner, cap)
    return SimulatePolicy(cfg.planner, cap)
