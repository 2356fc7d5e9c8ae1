"""Where a decision takes effect: one interface over local processes, Kubernetes and the
simulator, so every policy runs the same way offline and live."""

from __future__ import annotations

from typing import Protocol

from services.planner.decision import Split


class Actuator(Protocol):
    async def current(self) -> Split:
        """The split now running or starting (draining workers excluded). An actuator that
        sees a count changed by someone else (a hand-scaled Deployment) reports it: the
        planner adopts it rather than fights it."""
        ...

    async def apply(self, desired: Split) -> None:
        """Start what is missing and drain what is over. A drained worker leaves discovery
        first; a prefill worker finishes its job; a decode worker moves its running
        requests to another decode worker (docs/reliability.md, "Moving requests")."""
        ...
