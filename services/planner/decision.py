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

    def to_json(self) -> dict[str, int]:
        """The body of the launcher's control endpoint (services/launcher/control.py)."""
        return {"prefill": self.prefill, "decode": self.decode}

    @classmethod
    def from_json(cls, d: object) -> Split:
        """ValueError naming the field when ``d`` is not ``{"prefill": n, "decode": m}``."""
        if not isinstance(d, dict) or set(d) != {"prefill", "decode"}:
            raise ValueError('a split is {"prefill": <int>, "decode": <int>}')
        for k, v in d.items():
            if type(v) is not int or v < 0:
                raise ValueError(f"split.{k} must be a non-negative integer, got {v!r}")
        return cls(d["prefill"], d["decode"])


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
