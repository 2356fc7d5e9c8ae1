"""Source side of a move (docs/reliability.md "Moving requests on scale-down"): a draining
decode worker holds each running request's KV and lets the worker that continues it pull
the KV once.

``move_all`` holds every movable request in the engine (``AsyncEngine.hold_for_move``),
draws a one-time move token for each, and ends their Generate streams with a ``moved``
message naming this worker and the token (the processor routes the request again and
passes that on as ``move_from``); requests that cannot move are handed back (nothing kept:
the processor replays them). Then it waits until each held request was pulled
(``pull``, the MoveKv RPC) or ``decode.move_timeout_s`` passed, and frees what is left.
A held request's blocks are freed exactly once: after its one pull, whatever the outcome,
or at the timeout; so nothing leaks when a target never comes.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from services.api.move import MoveSource
from services.disagg.kv_wire import kv_chunks
from services.disagg.transfer_token import matches, new_token
from services.engine.async_engine import AsyncEngine
from services.engine.move import HeldRequest
from services.gen import worker_pb2


class MoveOutcome(enum.StrEnum):
    """How a request left a draining worker (``tandem_worker_requests_moved_total{outcome}``)."""

    PULLED = "pulled"  # its KV went to the worker that continues it
    EXPIRED = "expired"  # no pull within decode.move_timeout_s: freed (the target replays)
    FAILED = "failed"  # the pull asked for other blocks, or the stream broke (the target replays)
    HANDED_BACK = "handed_back"  # nothing to move (no token yet, n > 1): the processor replays


class MoveNotHeld(KeyError):
    """MoveKv for a request this worker does not hold (never, expired or pulled already)."""


class MoveTokenRefused(PermissionError):
    """MoveKv with a move token that is not the one drawn for the request."""


@dataclass(slots=True, eq=False)
class _Held:
    request: HeldRequest
    token: bytes = field(repr=False)
    since: float  # time.monotonic() when it was held
    pulling: bool = False


class MoveOutbox:
    """One draining decode worker's held requests. Use from the event loop thread only."""

    def __init__(self, engine: AsyncEngine, worker_id: str, chunk_bytes: int,
                 timeout_s: float,
                 on_moved: Callable[[MoveOutcome, float | None], None] | None = None,
                 on_handed_back: Callable[[str], None] | None = None) -> None:
        self._engine = engine
        # Called with each handed-back request id: a remote prefill waiting for its KV stops
        # waiting (the KvReceiver's cancel), so its stream ends now, not at its timeout.
        self._on_handed_back = on_handed_back or (lambda rid: None)
        self._worker_id = worker_id
        self._chunk_bytes = chunk_bytes
        self._timeout_s = timeout_s
        # (outcome, seconds from hold to the end of its move or None) per request
        self._on_moved = on_moved or (lambda outcome, seconds: None)
        self._held: dict[str, _Held] = {}
        self._empty = asyncio.Event()
        self._empty.set()
        self.address = ""  # this worker's gRPC address, as discovery published it

    @property
    def num_held(self) -> int:
        return len(self._held)

    def source(self, request_id: str) -> MoveSource | None:
        """Where the held request's KV waits (its stream's ``moved`` message); None when it
        is no longer held (freed at the timeout before its stream ended): a replay then."""
        h = self._held.get(request_id)
        return MoveSource(self._worker_id, self.address, h.token) if h is not None else None

    async def move_all(self) -> None:
        """Hold what can move, hand back the rest, end their streams; return once every held
        request was pulled or freed at the timeout."""
        hold = await self._engine.hold_for_move()
        now = time.monotonic()
        for r in hold.held:
            self._held[r.request_id] = _Held(r, new_token(), now)
        for rid in hold.handed_back:
            self._on_moved(MoveOutcome.HANDED_BACK, None)
            self._on_handed_back(rid)
        if self._held:
            self._empty.clear()
        self._engine.end_moved_streams(hold)
        try:
            await asyncio.wait_for(self._empty.wait(), self._timeout_s)
        except TimeoutError:
            for rid, h in list(self._held.items()):
                if not h.pulling:
                    self._release(rid, MoveOutcome.EXPIRED)
            await self._empty.wait()  # pulls under way end on their own (the RPC's timeout)
        finally:
            # NOTE: cancelled (the drain's grace ran out): free whatever is still held.
            for rid in list(self._held):
                self._release(rid, MoveOutcome.EXPIRED)

    async def pull(self, req: worker_pb2.MoveKvRequest) -> AsyncIterator[bytes]:
        """The serialized KvChunks of a held request's KV (its last token as the header's
        first_token, the caller's transfer token echoed). Raises before the first chunk:
        MoveNotHeld, MoveTokenRefused (the request stays held for the real target),
        MoveRefused (other blocks than held: the request is freed)."""
        rid = req.request_id
        h = self._held.get(rid)
        if h is None or h.pulling:
            raise MoveNotHeld(f"decode worker {self._worker_id} holds no request {rid!r} to move")
        if not matches(req.move_token, h.token):
            raise MoveTokenRefused(f"MoveKv for {rid!r} has a wrong move token")
        h.pulling = True
        outcome = MoveOutcome.FAILED
        try:
            kv, last = await self._engine.export_held(rid, req.first_block, req.num_blocks,
                                                      req.num_tokens)
            for chunk in kv_chunks(rid, kv, last, req.first_block, self._worker_id,
                                   self._chunk_bytes, req.transfer_token):
                yield chunk
            outcome = MoveOutcome.PULLED
        finally:
            self._release(rid, outcome)

    def _release(self, rid: str, outcome: MoveOutcome) -> None:
        h = self._held.pop(rid, None)
        if h is None:
            return
        self._engine.release_held(rid)
        self._on_moved(outcome, time.monotonic() - h.since)
        if not self._held:
            self._empty.set()
