"""When `tandem up` starts a dead part again, and when it stops trying.

Pure bookkeeping, no processes: the supervisor tells a ``RestartTracker`` that its process
died and how long it had been healthy, and gets back a ``RestartDecision``.

- Backoff: the first restart waits ``backoff_s``, each next one twice as long, capped at
  ``backoff_max_s``. A part that crashes in a loop then costs little CPU, and a part that
  died because a neighbour was briefly away (NATS restarting) comes back at once.
- A part that had been ready for ``stable_after_s`` when it died was healthy: its history
  is forgotten (backoff back to ``backoff_s``, quick failures back to zero).
- Any other death is a quick failure. After ``max_quick_restarts`` restarts that each died
  quickly, the next quick death gives up: a part that cannot start (a typo in a path, a
  port some other program holds) must end `tandem up` with an error, not loop unseen.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import LauncherConfig


@dataclass(frozen=True)
class RestartPolicy:
    backoff_s: float = 0.5
    backoff_max_s: float = 30.0
    stable_after_s: float = 60.0
    max_quick_restarts: int = 5

    @classmethod
    def from_config(cls, cfg: LauncherConfig) -> RestartPolicy:
        return cls(cfg.restart_backoff_s, cfg.restart_backoff_max_s, cfg.stable_after_s,
                   cfg.max_quick_restarts)

    def delay(self, deaths_in_a_row: int) -> float:
        """The wait before the restart after the ``deaths_in_a_row``-th death in a row."""
        return min(self.backoff_max_s, self.backoff_s * 2 ** max(0, deaths_in_a_row - 1))


@dataclass(frozen=True)
class RestartDecision:
    give_up: bool
    attempt: int  # the restart this is, counted since the launcher started (1 = the first)
    delay_s: float  # 0 when giving up
    quick_failures: int  # quick deaths in a row, this one included (0: it had been healthy)


class RestartTracker:
    """The failure history of one process of the plan."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self.restarts = 0
        self.deaths_in_a_row = 0  # sets the backoff
        self.quick_failures = 0  # sets when to give up

    def on_death(self, healthy_s: float) -> RestartDecision:
        """``healthy_s``: how long the process had been ready when it died (0 if never)."""
        if healthy_s >= self.policy.stable_after_s:
            self.deaths_in_a_row = self.quick_failures = 0
        else:
            self.quick_failures += 1
        self.deaths_in_a_row += 1
        if self.quick_failures > self.policy.max_quick_restarts:
            return RestartDecision(True, self.restarts, 0.0, self.quick_failures)
        self.restarts += 1
        return RestartDecision(False, self.restarts, self.policy.delay(self.deaths_in_a_row),
                               self.quick_failures)
