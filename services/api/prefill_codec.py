"""proto/prefill.proto <-> prefill.py: the prefill queue's message."""

from __future__ import annotations

from google.protobuf.message import DecodeError

from services.api.prefill import PrefillJob
from services.api.request_codec import request_sampling_from_pb, sampling_to_pb
from services.gen import prefill_pb2


def job_to_pb(j: PrefillJob) -> prefill_pb2.RemotePrefillRequest:
    return prefill_pb2.RemotePrefillRequest(
        request_id=j.request_id, token_ids=j.token_ids, sampling=sampling_to_pb(j.sampling),
        decode_worker_id=j.decode_worker_id, kv_transfer_address=j.kv_transfer_address,
        first_block=j.first_block, num_blocks=j.num_blocks,
        deadline_unix_ms=j.deadline_unix_ms, attempt=j.attempt,
        decode_host_id=j.decode_host_id, transfer_token=j.transfer_token)


def job_from_bytes(data: bytes) -> PrefillJob:
    """Raises ValueError for a message that is not a job or carries a bad field."""
    try:
        m = prefill_pb2.RemotePrefillRequest.FromString(data)
    except DecodeError as e:
        raise ValueError(f"not a RemotePrefillRequest: {e}") from None
    return PrefillJob(
        request_id=m.request_id, token_ids=tuple(m.token_ids),
        sampling=request_sampling_from_pb(m.request_id, m.sampling),
        decode_worker_id=m.decode_worker_id, kv_transfer_address=m.kv_transfer_address,
        first_block=m.first_block, num_blocks=m.num_blocks,
        deadline_unix_ms=m.deadline_unix_ms, attempt=m.attempt,
        decode_host_id=m.decode_host_id, transfer_token=m.transfer_token)
