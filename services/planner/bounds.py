"""The rules every policy keeps: the split within planner.min_*/max_* and
max_total_workers, and the action a change of split is."""

from __future__ import annotations

from services.common.config import PlannerConfig
from services.planner.decision import Action, Split


def fit(p: int, d: int, cfg: PlannerConfig, need_p: float = 0.0, need_d: float = 0.0) -> Split:
    """``(p, d)`` within the bounds; over the budget, the role with more workers per unit of
    need (``need_*``: fractional workers needed) gives one up at a time."""
    p = min(max(p, cfg.min_prefill), cfg.max_prefill)
    d = min(max(d, cfg.min_decode), cfg.max_decode)
    while p + d > cfg.max_total_workers:
        can_p, can_d = p > cfg.min_prefill, d > cfg.min_decode
        if can_p and (not can_d or p / max(need_p, 1e-9) >= d / max(need_d, 1e-9)):
            p -= 1
        else:
            d -= 1
    return Split(p, d)


def action_of(current: Split, desired: Split) -> Action:
    if desired == current:
        return Action.HOLD
    if desired.prefill >= current.prefill and desired.decode >= current.decode:
        return Action.SCALE_UP
    if desired.prefill <= current.prefill and desired.decode <= current.decode:
        return Action.SCALE_DOWN
    return Action.REBALANCE


def neighbours(split: Split, cfg: PlannerConfig) -> list[Split]:
    """``split`` and the splits one worker of either role away from it, within bounds and
    budget (duplicates dropped, in a fixed order)."""
    out: list[Split] = []
    for dp, dd in ((0, 0), (1, 0), (-1, 0), (0, 1), (0, -1), (1, -1), (-1, 1)):
        p, d = split.prefill + dp, split.decode + dd
        if (cfg.min_prefill <= p <= cfg.max_prefill and cfg.min_decode <= d <= cfg.max_decode
                and p + d <= cfg.max_total_workers):
            s = Split(p, d)
            if s not in out:
                out.append(s)
    return out
