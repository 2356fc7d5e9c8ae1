"""The interface a sizing policy offers the planner's loop (services/planner/loop.py) and
the simulator's planner runs alike."""

from __future__ import annotations

from typing import Protocol

from services.planner.decision import Decision, Split
from services.planner.signals import ClusterSignals


class Policy(Protocol):
    def decide(self, signals: ClusterSignals, current: Split) -> Decision:
        """The split wanted for the next intervals, given this interval's signals and the
        split now running. Bounds (planner.min_*/max_*, max_total_workers) and the
        cooldown are the policy's to keep; it may keep state between calls."""
        ...
