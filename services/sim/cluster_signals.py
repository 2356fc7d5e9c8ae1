"""What the planner reads of a simulated cluster each interval: the same ClusterSignals a
live cluster gives it (services/planner/signals.py), read off the Simulation's state."""

from __future__ import annotations

import numpy as np

from services.planner.signals import ClusterSignals, IntervalStats, Role, WorkerSignals
from services.sim.report import weighted_percentiles
from services.sim.simulator import DECODE, Simulation


def _p90(values: list[float]) -> float | None:
    return float(np.percentile(values, 90)) if values else None


class SignalReader:
    """Reads one ClusterSignals per call; keeps where the last interval ended (the next
    arrival, the pooled gaps and the prefill workers' totals then)."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        self._t = 0.0
        self._arrival = 0  # index into sim.requests (sorted by arrival)
        self._gap = 0  # index into sim.gaps
        self._prefill_done = 0
        self._prefill_busy = 0.0

    def read(self) -> ClusterSignals:
        sim = self.sim
        now = sim.now
        return ClusterSignals(t=now, workers=self._workers(), **self._queue(),
                              last=self._interval(now))

    def _workers(self) -> tuple[WorkerSignals, ...]:
        sim = self.sim
        out: list[WorkerSignals] = []
        groups = ((sim.decoders, True), (sim.prefillers, True), (sim.starting, False),
                  (sim.leaving, False))
        for group, ready in groups:
            for w in group:
                st = w.engine.stats()
                left = 0
                for s in w.engine.scheduler.running:
                    rec = sim.records.get(s.request_id)
                    if rec is not None:
                        left += rec.output_tokens - rec.tokens_out
                out.append(WorkerSignals(
                    w.id, Role.DECODE if w.role == DECODE else Role.PREFILL,
                    st.kv_blocks_used, st.kv_blocks_total, st.num_running, st.num_waiting,
                    st.num_prefill_tokens_pending, decode_tokens_left=left,
                    ready=ready and not w.draining))
        return tuple(out)

    def _queue(self) -> dict[str, float | int]:
        q = self.sim.queue
        if q is None or not q.pending:
            return {}
        return {"prefill_queue_jobs": len(q.pending),
                "prefill_queue_tokens": sum(j.effective_tokens for j in q.pending),
                "prefill_queue_oldest_wait_s": self.sim.now - q.pending[0].published_s}

    def _interval(self, now: float) -> IntervalStats:
        sim, t0 = self.sim, self._t
        reqs = sim.requests
        i = self._arrival
        j = i
        while j < len(reqs) and reqs[j].arrival_s < now:
            j += 1
        new = reqs[i:j]
        self._arrival = j
        ttft: list[float] = []
        for r in sim.records.values():
            if r.tokens_out and t0 <= r.first_token_s < now:
                ttft.append(r.ttft_s)
        g = sim.gaps
        vals, counts = g.values[self._gap:], g.counts[self._gap:]
        self._gap = len(g.values)
        itl = (weighted_percentiles(np.asarray(vals), np.asarray(counts), (90,))[0]
               if vals and sum(counts) else None)
        done = busy = 0.0
        for w in sim.prefillers + sim.leaving + sim.gone:
            if w.role != DECODE:
                done += w.totals.prompt_tokens - w.totals.hit_tokens
                busy += w.totals.busy_s
        stats = IntervalStats(
            duration_s=now - t0, arrivals=len(new),
            mean_input_tokens=sum(r.input_len for r in new) / len(new) if new else 0.0,
            mean_output_tokens=sum(r.output_len for r in new) / len(new) if new else 0.0,
            ttft_p90_s=_p90(ttft), itl_p90_s=itl,
            prefill_tokens_done=int(done - self._prefill_done),
            prefill_busy_s=busy - self._prefill_busy)
        self._t, self._prefill_done, self._prefill_busy = now, int(done), busy
        return stats
