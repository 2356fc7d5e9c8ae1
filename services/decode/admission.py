"""Whether a decode worker takes one more request: its bounds on requests in flight and
waiting (``decode.max_inflight_requests``, ``decode.max_waiting_requests``)."""

from __future__ import annotations

from services.common.config import DecodeConfig
from services.common.errors import Overloaded


def refusal(worker_id: str, inflight: int, running: int, cfg: DecodeConfig) -> Overloaded | None:
    """The error to refuse a request with (HTTP 429), or None to take it. ``inflight``:
    requests the worker holds; ``running``: those its engine runs (the rest wait)."""
    if inflight >= cfg.max_inflight_requests:
        return Overloaded(
            f"decode worker {worker_id} has {inflight} requests in flight "
            f"(decode.max_inflight_requests={cfg.max_inflight_requests})", code="overloaded")
    waiting = inflight - running
    if waiting >= cfg.max_waiting_requests:
        return Overloaded(
            f"decode worker {worker_id} has {waiting} requests waiting "
            f"(decode.max_waiting_requests={cfg.max_waiting_requests})", code="overloaded")
    return None
