"""Bytes on NATS: KV event batches, dumps, load metrics and router in-flight updates.

msgpack with compact arrays (not a dict per block) because the router ingests hundreds of
thousands of blocks per second. Every message starts with a format version so a later
change is detected instead of misread. Decoding anything else raises ``WireError``.

Event batch  : [1, worker_id, session, [event, ...]]
  stored     : [0, event_id, parent_seq_hash | None, [seq_hash, ...], [local_hash, ...]]
  removed    : [1, event_id, [seq_hash, ...]]
  cleared    : [2, event_id]
Dump reply   : [1, worker_id, session, last_event_id, [event, ...]]
Load         : [1, worker_id, used, total, running, waiting, prefill_tokens, timestamp]
In-flight    : [1, replica_id, op, request_id, worker_id, prompt_blocks, prefill_blocks]
Cache reset  : [1, worker_id, role, evicted_blocks, blocks_in_use]   (a worker's reply)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

import msgpack

from services.api.kv_events import KvCleared, KvEvent, KvRemoved, KvStored, StoredBlock

VERSION = 1
STORED, REMOVED, CLEARED = 0, 1, 2  # event kinds in the compact (raw) form


class WireError(ValueError):
    """Bytes that are not a valid tandem message of the expected kind."""


@dataclass(frozen=True, slots=True)
class EventBatch:
    """Events of one worker in event-id order. ``session`` changes when the worker restarts
    (its event ids start again at 1), so a consumer can tell a restart from a replay."""

    worker_id: str
    session: int
    events: list[KvEvent]


@dataclass(frozen=True, slots=True)
class DumpReply:
    """A worker's whole cache as events (KvCleared, then KvStored chains), reflecting at least
    every event up to ``last_event_id``; later events may be included too (replay is safe)."""

    worker_id: str
    session: int
    last_event_id: int
    events: list[KvEvent]


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """A worker's load sample. ``kv_blocks_used`` counts blocks a live request references."""

    worker_id: str
    kv_blocks_used: int
    kv_blocks_total: int
    requests_running: int
    requests_waiting: int
    # Prompt tokens still to compute: waiting requests less their prefix-cache hits, running
    # ones still prefilling (EngineStats.num_prefill_tokens_pending).
    active_prefill_tokens: int
    timestamp: float  # unix seconds at the worker
    # Output tokens its running requests that set max_tokens may still produce (max_tokens
    # less what they generated: an upper bound, a stop ends some sooner), and how many
    # running requests set none (the planner prices those at its forecast's length).
    decode_tokens_left: int = 0
    running_unbounded: int = 0


class InflightOp(IntEnum):
    ADD = 0  # routed: prompt blocks and prefill blocks now count against the worker
    PREFILLED = 1  # first token out: its prefill no longer counts
    FREE = 2  # finished or aborted


@dataclass(frozen=True, slots=True)
class InflightUpdate:
    replica_id: str
    op: InflightOp
    request_id: str
    worker_id: str = ""
    prompt_blocks: int = 0
    prefill_blocks: int = 0


@dataclass(frozen=True, slots=True)
class CacheResetReply:
    """A worker's answer to a prefix-cache reset: the cached blocks it evicted, and the
    blocks its live requests still hold (kept; cached again once they finish)."""

    worker_id: str
    role: str  # "decode" or "prefill"
    evicted_blocks: int
    blocks_in_use: int


def raw_event(e: KvEvent) -> list:
    """An event in the compact array form of RawEventBatch (what is packed on the wire)."""
    if isinstance(e, KvStored):
        return [
            STORED, e.event_id, e.parent_seq_hash,
            [b.seq_hash for b in e.blocks], [b.local_hash for b in e.blocks],
        ]
    if isinstance(e, KvRemoved):
        return [REMOVED, e.event_id, list(e.seq_hashes)]
    if isinstance(e, KvCleared):
        return [CLEARED, e.event_id]
    raise TypeError(f"not a KV event: {type(e).__name__}")


def _check_raw_events(raw: object) -> list[list]:
    """Validate the per-event structure (not each hash: that would cost the ingest rate)."""
    if not isinstance(raw, list):
        raise WireError("event list is not an array")
    for r in raw:
        if not isinstance(r, list) or len(r) < 2 or not isinstance(r[1], int):
            raise WireError("event is not [kind, event_id, ...]")
        kind = r[0]
        if kind == STORED:
            if len(r) != 5 or not isinstance(r[3], list) or not isinstance(r[4], list):
                raise WireError("stored event is not [0, id, parent, seq_hashes, local_hashes]")
            if len(r[3]) != len(r[4]):
                raise WireError("stored event has unequal seq/local hash arrays")
        elif kind == REMOVED:
            if len(r) != 3 or not isinstance(r[2], list):
                raise WireError("removed event is not [1, id, seq_hashes]")
        elif kind == CLEARED:
            if len(r) != 2:
                raise WireError("cleared event is not [2, id]")
        else:
            raise WireError(f"unknown event kind {kind!r}")
    return raw  # type: ignore[return-value]


def _typed(worker_id: str, raw: list[list]) -> list[KvEvent]:
    out: list[KvEvent] = []
    for r in raw:
        if r[0] == STORED:
            out.append(KvStored(worker_id, r[1], r[2], tuple(map(StoredBlock, r[3], r[4]))))
        elif r[0] == REMOVED:
            out.append(KvRemoved(worker_id, r[1], tuple(r[2])))
        else:
            out.append(KvCleared(worker_id, r[1]))
    return out


def _unpack(data: bytes, what: str, n: int) -> list:
    try:
        msg = msgpack.unpackb(data, use_list=True, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise WireError(f"{what}: not msgpack ({e})") from None
    if not isinstance(msg, list) or len(msg) != n:
        raise WireError(f"{what}: expected an array of {n}")
    if msg[0] != VERSION:
        raise WireError(f"{what}: unsupported version {msg[0]!r}")
    return msg


@dataclass(frozen=True, slots=True)
class RawEventBatch:
    """An event batch left in its compact array form (see the module docstring): the
    router's ingest applies these directly, skipping one object per block."""

    worker_id: str
    session: int
    events: list[list]


def decode_event_batch_raw(data: bytes) -> RawEventBatch:
    msg = _unpack(data, "kv event batch", 4)
    if not isinstance(msg[1], str) or not isinstance(msg[2], int):
        raise WireError("kv event batch: bad worker id or session")
    return RawEventBatch(msg[1], msg[2], _check_raw_events(msg[3]))


def encode_event_batch(worker_id: str, session: int, events: Sequence[KvEvent]) -> bytes:
    return msgpack.packb([VERSION, worker_id, session, [raw_event(e) for e in events]])


def decode_event_batch(data: bytes) -> EventBatch:
    raw = decode_event_batch_raw(data)
    return EventBatch(raw.worker_id, raw.session, _typed(raw.worker_id, raw.events))


def encode_dump(
    worker_id: str, session: int, last_event_id: int, events: Sequence[KvEvent]
) -> bytes:
    return msgpack.packb(
        [VERSION, worker_id, session, last_event_id, [raw_event(e) for e in events]]
    )


@dataclass(frozen=True, slots=True)
class RawDumpReply:
    worker_id: str
    session: int
    last_event_id: int
    events: list[list]  # compact form


def decode_dump_raw(data: bytes) -> RawDumpReply:
    m = _unpack(data, "kv dump", 5)
    if not isinstance(m[1], str) or not isinstance(m[2], int) or not isinstance(m[3], int):
        raise WireError("kv dump: bad worker id, session or last event id")
    return RawDumpReply(m[1], m[2], m[3], _check_raw_events(m[4]))


def decode_dump(data: bytes) -> DumpReply:
    r = decode_dump_raw(data)
    return DumpReply(r.worker_id, r.session, r.last_event_id, _typed(r.worker_id, r.events))


def encode_load(load: WorkerLoad) -> bytes:
    return msgpack.packb([
        VERSION, load.worker_id, load.kv_blocks_used, load.kv_blocks_total,
        load.requests_running, load.requests_waiting, load.active_prefill_tokens, load.timestamp,
        load.decode_tokens_left, load.running_unbounded,
    ])


def decode_load(data: bytes) -> WorkerLoad:
    m = _unpack(data, "worker load", 10)
    try:
        return WorkerLoad(str(m[1]), int(m[2]), int(m[3]), int(m[4]), int(m[5]), int(m[6]), float(m[7]),
                          int(m[8]), int(m[9]))
    except (TypeError, ValueError) as e:
        raise WireError(f"worker load: bad field ({e})") from None


def encode_inflight(u: InflightUpdate) -> bytes:
    return msgpack.packb([
        VERSION, u.replica_id, int(u.op), u.request_id, u.worker_id, u.prompt_blocks,
        u.prefill_blocks,
    ])


def decode_inflight(data: bytes) -> InflightUpdate:
    m = _unpack(data, "inflight update", 7)
    try:
        return InflightUpdate(str(m[1]), InflightOp(m[2]), str(m[3]), str(m[4]), int(m[5]), int(m[6]))
    except (TypeError, ValueError) as e:
        raise WireError(f"inflight update: bad field ({e})") from None


def encode_cache_reset(r: CacheResetReply) -> bytes:
    return msgpack.packb([VERSION, r.worker_id, r.role, r.evicted_blocks, r.blocks_in_use])


def decode_cache_reset(data: bytes) -> CacheResetReply:
    m = _unpack(data, "cache reset reply", 5)
    if not isinstance(m[1], str) or not isinstance(m[2], str):
        raise WireError("cache reset reply: worker id and role must be strings")
    try:
        return CacheResetReply(m[1], m[2], int(m[3]), int(m[4]))
    except (TypeError, ValueError) as e:
        raise WireError(f"cache reset reply: bad field ({e})") from None
