"""What the processor asks a router and what it answers: the route of a request and the
updates that free its load (proto/router.proto; codec: route_codec.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """``token_ids`` (the prompt) or, when the caller hashed already, ``local_hashes`` (one per
    full block, from services.common.hashing.local_block_hashes at the cluster's
    ``engine.block_size``; u64 ints). One must be non-empty; ``local_hashes`` wins when both
    are (and must then number ``len(token_ids) // block_size``).
    ``exclude_workers``: worker ids not to pick (the processor names workers that died
    under this request when it migrates it)."""

    request_id: str
    token_ids: Sequence[int] = ()
    local_hashes: Sequence[int] | None = None
    exclude_workers: Sequence[str] = ()


@dataclass(frozen=True, slots=True)
class RouteResponse:
    worker_id: str
    overlap_blocks: int  # blocks of the prompt already cached on that worker
    request_blocks: int  # full blocks in the prompt
    prefix_hit_rate: float  # overlap_blocks / request_blocks (0 for a prompt under one block)
    address: str = ""  # the worker's gRPC address from discovery ("" if it announced none)


class RequestPhase(Enum):
    PREFILLED = "prefilled"  # first token out: its prefill no longer loads the worker
    FINISHED = "finished"  # done or aborted: forget it
