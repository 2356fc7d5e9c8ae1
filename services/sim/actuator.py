"""The simulator's actuator: a decision's split carried out on a Simulation, with the
cost a live one has (a started worker serves ``worker_ready_s`` later; a drained one
finishes or moves its work first)."""

from __future__ import annotations

from services.planner.decision import Split
from services.sim.simulator import DECODE, PREFILL, Simulation, _Worker


class SimActuator:
    """Implements services.planner.actuator.Actuator over one Simulation."""

    def __init__(self, sim: Simulation, worker_ready_s: float) -> None:
        self.sim = sim
        self.ready_s = worker_ready_s
        self.started = 0
        self.drained = 0

    async def current(self) -> Split:
        return self.split()

    def split(self) -> Split:
        """Ready and starting workers of each role; draining ones are on their way out."""
        sim = self.sim
        starting_p = sum(1 for w in sim.starting if w.role == PREFILL)
        ready_p = sum(1 for w in sim.prefillers if not w.draining)
        return Split(ready_p + starting_p, len(sim.decoders) + len(sim.starting) - starting_p)

    async def apply(self, desired: Split) -> None:
        have = self.split()
        self._role(PREFILL, desired.prefill - have.prefill)
        self._role(DECODE, desired.decode - have.decode)

    def _role(self, role: str, delta: int) -> None:
        sim = self.sim
        for _ in range(delta):
            sim.add_worker(role, self.ready_s)
            self.started += 1
        for _ in range(-delta):
            w = self._victim(role)
            if w is None or not sim.drain_worker(w.id):
                return
            self.drained += 1

    def _victim(self, role: str) -> _Worker | None:
        """The ready worker whose leaving costs least: the decode worker with the fewest KV
        blocks to move, the prefill worker with the fewest jobs."""
        sim = self.sim
        if role == DECODE:
            return min(sim.decoders, key=lambda w: (w.engine.pool.num_used, w.id), default=None)
        ready = [w for w in sim.prefillers if not w.draining]
        return max(ready, key=lambda w: (w.free_slots, w.id), default=None)
