"""The policy ``planner.policy`` names, built for a cluster config."""

from __future__ import annotations

from services.common.config import ClusterConfig
from services.planner.capacity import Capacity
from services.planner.formula import FormulaPolicy
from services.planner.lookahead import SimulatePolicy
from services.planner.policy import Policy
from services.planner.stabilize import Stabilized
from services.steptime.model import StepModel


def policy_for(cfg: ClusterConfig, model: StepModel) -> Policy:
    cap = Capacity.of(cfg, model)
    pc = cfg.planner
    inner: Policy = FormulaPolicy(pc, cap) if pc.policy == "formula" else SimulatePolicy(pc, cap)
    return Stabilized(inner, pc.scale_down_window_s, pc.max_total_workers, cfg.engine.max_num_seqs)
