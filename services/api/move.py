"""A request moved off a draining decode worker (docs/reliability.md "Moving requests on
scale-down"): where its KV waits, and the event that ends its stream there. Wire form:
proto/worker.proto's MoveSource (codec: worker_codec.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.errors import Unavailable


@dataclass(frozen=True, slots=True)
class MoveSource:
    """The draining worker holding a moved request's KV for one ``MoveKv`` pull."""

    worker_id: str
    address: str  # its gRPC address
    # The one-time token it drew for the request (transfer_token.new_token()); out of repr
    # so it never reaches a log line.
    token: bytes = field(repr=False)


class RequestMoved(Unavailable):
    """The worker streaming a request is draining and ended the stream: continue it on
    another worker, from ``source`` (its KV waits there) or, None, by replay (nothing was
    kept). An Unavailable, so a caller that knows nothing of moves migrates it by replay."""

    def __init__(self, message: str, source: MoveSource | None) -> None:
        super().__init__(message)
        self.source = source
