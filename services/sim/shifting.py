"""A load whose shape moves: phases of Poisson arrivals, each with its own rate and prompt
and output lengths (each request's drawn uniformly within +-25% of the phase's means).

``shifting_phases``: short prompts with long outputs (decode-heavy), then long prompts with
short outputs (prefill-heavy), then back; rates scaled with the worker budget, so that the
best split of each phase differs and no fixed split serves both (docs/planner.md).
Prompts are unique (no shared prefix): the split, not the prefix cache, is what is measured.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from services.sim.requests import SimRequest

SPREAD = 0.25


@dataclass(frozen=True, slots=True)
class Phase:
    duration_s: float
    rate: float  # requests per second
    input_tokens: int
    output_tokens: int


def shifting_phases(budget: int = 8, phase_s: float = 180.0, time_scale: float = 1.0) -> list[Phase]:
    """Three phases for a budget of ``budget`` workers (rates scale with it from 8).

    ``time_scale`` K: the same load for a device K times slower (``time_scale_settings`` in
    services/sim/planner_eval.py): each phase K times as long, its rate K times lower."""
    k = budget / 8
    decode_heavy = Phase(phase_s * time_scale, 2.5 * k / time_scale, 360, 1500)
    prefill_heavy = Phase(phase_s * time_scale, 4.0 * k / time_scale, 700, 40)
    return [decode_heavy, prefill_heavy, decode_heavy]


def shifting(phases: list[Phase], seed: int = 0) -> list[SimRequest]:
    rng = np.random.default_rng(seed)
    out: list[SimRequest] = []
    start = 0.0
    for ph in phases:
        t = start
        while True:
            t += float(rng.exponential(1 / ph.rate))
            if t >= start + ph.duration_s:
                break
            lo, hi = 1 - SPREAD, 1 + SPREAD
            n_in = max(1, round(ph.input_tokens * rng.uniform(lo, hi)))
            n_out = max(1, round(ph.output_tokens * rng.uniform(lo, hi)))
            out.append(SimRequest(len(out), t, n_in, n_out))
        start += ph.duration_s
    return out
