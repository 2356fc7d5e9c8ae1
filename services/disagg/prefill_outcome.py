"""How a decode worker's request got its prompt KV: where it was computed and, for a remote
prefill that ended local, why (the labels of the decode worker's prefill metrics)."""

from __future__ import annotations

import enum


class PrefillLocation(enum.StrEnum):
    """Where a request's prompt KV was computed (the ``where`` label of
    tandem_worker_prefill_total)."""

    LOCAL = "local"
    REMOTE = "remote"


class FallbackReason(enum.StrEnum):
    """Why a remote prefill ended as a local one (tandem_worker_remote_prefill_fallbacks_total)."""

    NO_BLOCKS = "no_blocks"  # its blocks did not fit when parking: the scheduler waits for room
    PUBLISH_FAILED = "publish_failed"  # NATS down or the stream missing
    TIMEOUT = "timeout"  # no KV before decode.disagg.remote_prefill_timeout_s
    BAD_KV = "bad_kv"  # the KV that came does not match what was asked
