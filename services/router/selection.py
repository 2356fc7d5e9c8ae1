"""Worker selection for the `kv` mode: a pure function of the candidates' state.

For a request of ``B`` full blocks and each candidate worker ``w``:

    prefill_blocks(w) = (B - overlap(w)) + pending_prefill(w)
    evicted_blocks(w) = max((B - overlap(w)) - max(unused(w) - pending_prefill(w), 0), 0)
    decode_blocks(w)  = active_blocks(w) + B
    cost(w)           = overlap_weight * (prefill_blocks(w) + eviction_weight * evicted_blocks(w))
                        + decode_blocks(w)

``overlap(w)`` is the prefix the worker already caches (from the index), ``pending_prefill``
the prompt blocks it still has to prefill for requests already sent to it, ``active_blocks``
the KV blocks its running requests occupy (the load tracker merges the worker's own metrics
with what the routers sent it and have not seen finish). The first term prices the compute
the request would cost on that worker, the second the memory pressure it would join.

``unused(w)`` is the worker's KV blocks that hold nothing, neither a live request nor a
cached prefix (its total less the blocks the index holds for it; unknown without a fresh
load sample, and then nothing is evicted). ``evicted_blocks`` are the cached blocks the
request's uncached part would push out once the prefills queued ahead have filled that space:
blocks some later request would have hit and now recomputes. ``eviction_weight`` prices one
at that fraction of a block to prefill now. Without it, a worker that has never served a
request ranks behind every worker that caches the prompt's shared first block (a system
prompt), however full their caches: new conversations then crowd onto the workers already
used and evict each other's earlier turns, while the other workers' caches sit empty
(docs/benchmarks.md "The whole conversation trace").

temperature == 0: the lowest cost wins; ties go to the worker with fewer active blocks, and
remaining ties are broken uniformly at random (so idle workers share a burst).
temperature > 0: sample from softmax(-normalised_cost / temperature), with costs normalised
to [0, 1] by (cost - min) / (max - min) so the temperature does not depend on prompt length.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple


class Candidate(NamedTuple):
    """One worker's state for a route. A NamedTuple: 64 of these are built per route and a
    frozen dataclass costs ~5x more to construct."""

    worker_id: str
    overlap_blocks: int
    pending_prefill_blocks: int
    active_blocks: int
    unused_blocks: int = -1  # KV blocks holding nothing (-1: unknown)


@dataclass(frozen=True, slots=True)
class Selection:
    worker_id: str
    overlap_blocks: int
    cost: float


def evicted_blocks(uncached: int, pending_prefill: int, unused: int) -> int:
    """Cached blocks a prefill of ``uncached`` blocks pushes out of a worker with ``unused``
    empty blocks (-1: unknown, none assumed) once ``pending_prefill`` blocks queued ahead
    of it have been written (module docstring)."""
    if unused < 0:
        return 0
    room = unused - pending_prefill if unused > pending_prefill else 0
    return uncached - room if uncached > room else 0


def cost(c: Candidate, request_blocks: int, overlap_weight: float,
         eviction_weight: float = 0.0) -> float:
    """The cost of sending a request of ``request_blocks`` to ``c`` (module docstring)."""
    uncached = max(request_blocks - c.overlap_blocks, 0)
    prefill = uncached + c.pending_prefill_blocks
    evicted = evicted_blocks(uncached, c.pending_prefill_blocks, c.unused_blocks)
    decode = c.active_blocks + request_blocks
    return overlap_weight * (prefill + eviction_weight * evicted) + decode


def select_worker(
    candidates: Sequence[Candidate],
    request_blocks: int,
    overlap_weight: float,
    temperature: float,
    rng: random.Random,
    eviction_weight: float = 0.0,
) -> Selection:
    """Pick a worker by the cost in the module docstring. Raises ValueError on no candidates."""
    if not candidates:
        raise ValueError("select_worker: no candidate workers")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    # NOTE: ``cost`` and ``evicted_blocks`` inlined: this runs for every worker on every route.
    price = overlap_weight * eviction_weight
    costs = []
    append = costs.append
    for _, ov, pending, active, unused in candidates:
        uncached = request_blocks - ov if ov < request_blocks else 0
        c = overlap_weight * (uncached + pending) + active + request_blocks
        if price and unused >= 0:
            room = unused - pending if unused > pending else 0
            if uncached > room:
                c += price * (uncached - room)
        append(c)
    if temperature == 0:
        best = min(costs)
        tied = [i for i, x in enumerate(costs) if x == best]
        if len(tied) > 1:
            lightest = min(candidates[i].active_blocks for i in tied)
            tied = [i for i in tied if candidates[i].active_blocks == lightest]
        i = tied[0] if len(tied) == 1 else rng.choice(tied)
    else:
        lo, hi = min(costs), max(costs)
        span = hi - lo
        if span == 0:
            i = rng.randrange(len(candidates))
        else:
            weights = [math.exp(-((x - lo) / span) / temperature) for x in costs]
            i = rng.choices(range(len(candidates)), weights=weights, k=1)[0]
    c = candidates[i]
    return Selection(c.worker_id, c.overlap_blocks, costs[i])
