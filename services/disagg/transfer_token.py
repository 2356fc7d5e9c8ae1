"""The one-time transfer token of a remote prefill.

The decode worker draws one per job and puts it in the job; the prefill worker copies it
into the KvTransfer header; the decode worker accepts that request's KV only with it. A
request id alone is no credential: ids travel on NATS subjects that any client of the
server may read, and a KvTransfer naming one would otherwise be imported as that request's
prompt KV (and cached for later requests).
"""

from __future__ import annotations

import hmac
import secrets

TOKEN_BYTES = 32  # 256 random bits; a job whose token is shorter is refused


def new_token() -> bytes:
    return secrets.token_bytes(TOKEN_BYTES)


def well_formed(token: bytes) -> bool:
    """The shape of a token this cluster draws (a job without one was not made by it)."""
    return len(token) == TOKEN_BYTES


def matches(presented: bytes, expected: bytes) -> bool:
    """Constant time in the bytes compared: the time taken does not tell a forger how many
    leading bytes it guessed right."""
    return hmac.compare_digest(presented, expected)
