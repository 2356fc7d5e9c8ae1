"""Encode side of the same-host embedding path: a chunk's rows written straight from the
block buffer into the shared-memory segment the language side named in its ask (one copy;
the reply then carries the header only). Mappings are kept by name for the next asks
naming the same segment (services/disagg/shm_pool.py)."""

from __future__ import annotations

import torch

from services.api.embedding import ShmTarget
from services.disagg.kv_shm import MM_PREFIX, ShmUnavailableError, host_id, map_segment
from services.disagg.shm_pool import MappedSegments, payload_view


class ShmPlacer:
    """Use from the encode thread only (one thread)."""

    def __init__(self, max_bytes: int, host: str | None = None) -> None:
        self.host = host_id() if host is None else host
        self.mapped = MappedSegments(max_bytes)

    def place(self, target: ShmTarget, rows: torch.Tensor) -> torch.Tensor | None:
        """``rows`` copied into ``target``: a view of them there, or None when the target
        cannot be used from here (another host, not mappable, too small: send bytes)."""
        nbytes = rows.numel() * rows.element_size()
        # NOTE: embedding segments only: an ask can never make this worker write into a KV one.
        if (not self.host or target.host_id != self.host or not target.name.startswith(MM_PREFIX)
                or target.offset + nbytes > target.size):
            return None
        mm = self.mapped.get(target.name)
        if mm is None or len(mm) != target.size:
            try:
                mm = map_segment(target.name, target.size)
            except (ShmUnavailableError, ValueError):
                return None
            self.mapped.add(target.name, mm)
        dst = payload_view(mm, target.offset, nbytes)
        dst.copy_(rows.contiguous().reshape(-1).view(torch.uint8))
        return dst.view(rows.dtype).view(rows.shape)
