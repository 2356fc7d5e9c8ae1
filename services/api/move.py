"""Where the KV of a request moved off a draining decode worker waits (docs/reliability.md
"Moving requests on scale-down"). Wire form: proto/worker.proto's MoveSource (codec:
worker_codec.py); the event that ends its stream there is services/common/errors.py's
RequestMoved."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class MoveSource:
    """The draining worker holding a moved request's KV for one ``MoveKv`` pull."""

    worker_id: str
    address: str  # its gRPC address
    # The one-time token it drew for the request (transfer_token.new_token()); out of repr
    # so it never reaches a log line.
    token: bytes = field(repr=False)
