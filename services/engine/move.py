"""What the engine hands a draining decode worker that moves its requests
(docs/reliability.md "Moving requests on scale-down"): the requests it holds for export
and those it gave back. The flow lives on the scheduler (``Scheduler.hold_for_move`` /
``export_held``); the worker's side is services/decode/move_out.py."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.api.outputs import TokenOutput


@dataclass(frozen=True, slots=True)
class HeldRequest:
    """A request taken off the schedule with its blocks kept: the KV of its first
    ``num_tokens`` tokens (prompt + produced, less the last produced token, whose KV the
    next step would have computed) is in ``num_blocks`` blocks."""

    request_id: str
    num_tokens: int
    num_blocks: int


@dataclass(frozen=True, slots=True)
class MoveHold:
    """``LLMEngine.hold_for_move``'s result: the held requests, the ids of those aborted to
    go back to the processor (nothing produced, or not movable), and the outputs of the
    batch that was in flight (to stream before either)."""

    held: list[HeldRequest]
    handed_back: list[str]
    outputs: list[TokenOutput] = field(default_factory=list)


class MoveRefused(ValueError):
    """An export asked for blocks or tokens that are not the held request's."""
