"""The prefill queue's message: what a decode worker asks a prefill worker to compute
(proto/prefill.proto; codec: prefill_codec.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.api.sampling import SamplingParams


@dataclass(frozen=True, slots=True)
class PrefillJob:
    """Run ``token_ids`` and send the KV of prompt blocks ``[first_block, +num_blocks)`` and
    the first sampled token to ``kv_transfer_address`` (the decode worker's KvTransfer), if
    discovery lists that address for ``decode_worker_id``, with ``transfer_token``."""

    request_id: str
    token_ids: tuple[int, ...]  # the whole prompt
    # The request's own sampling: the first token is sampled with it (and its seed), so the
    # remote path produces what a local prefill would.
    sampling: SamplingParams
    decode_worker_id: str
    kv_transfer_address: str
    first_block: int
    num_blocks: int
    deadline_unix_ms: int  # past it the decode worker no longer waits: drop the job
    attempt: int = 1
    # The decode worker's kv_shm.host_id(): a prefill worker with the same id may pass the
    # KV through /dev/shm instead of gRPC bytes ("" = never).
    decode_host_id: str = ""
    # The one-time token the decode worker accepts this request's KV with
    # (services/disagg/transfer_token.py); out of repr so it never reaches a log line.
    transfer_token: bytes = field(default=b"", repr=False)
