"""A split of the worker budget and the planner's decision about it: one record per
interval, logged and exported as ``tandem_planner_decisions_total{action,reason}``."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


@dataclass(frozen=True, slots=True, order=True)
class Split:
    prefill: int
    decode: int

    @property
    def total(self) -> int:
        return self.prefill + self.decode


class Action(StrEnum):
    HOLD = "hold"
    SCALE_UP = "scale_up"
    SCALE_DOWN = "scale_down"
    REBALANCE = "rebalance"  # one role up, the other down (or a role switch)


@dataclass(frozen=True, slots=True)
class Decision:
    t: float
    current: Split
    desired: Split
    action: Action
    reason: str  # a short label for the metric: "ttft_forecast", "cooldown", "bounds", ...
    detail: str = ""  # the log line's explanation (forecast, the candidates' predicted figures)
