"""Wire codecs round-trip and reject garbage with a typed error."""

from __future__ import annotations

import msgpack
import pytest

from services.api.kv_events import KvCleared, KvRemoved, KvStored, StoredBlock
from services.api.wire import (
    CacheResetReply,
    InflightOp,
    InflightUpdate,
    WireError,
    WorkerLoad,
    decode_cache_reset,
    decode_dump,
    decode_event_batch,
    decode_event_batch_raw,
    decode_inflight,
    decode_load,
    encode_cache_reset,
    encode_dump,
    encode_event_batch,
    encode_inflight,
    encode_load,
)

EVENTS = [
    KvCleared("w1", 1),
    KvStored("w1", 2, None, (StoredBlock(2**64 - 1, 7), StoredBlock(3, 8))),
    KvStored("w1", 3, 3, (StoredBlock(4, 9),)),
    KvRemoved("w1", 4, (4, 3)),
]


def test_event_batch_and_dump_round_trip() -> None:
    b = decode_event_batch(encode_event_batch("w1", 77, EVENTS))
    assert (b.worker_id, b.session, b.events) == ("w1", 77, EVENTS)
    d = decode_dump(encode_dump("w1", 77, 4, EVENTS[:3]))
    assert (d.last_event_id, d.events) == (4, EVENTS[:3])
    raw = decode_event_batch_raw(encode_event_batch("w1", 77, EVENTS[1:2]))
    assert raw.events == [[0, 2, None, [2**64 - 1, 3], [7, 8]]]


def test_load_and_inflight_round_trip() -> None:
    load = WorkerLoad("w", 1, 2, 3, 4, 5, 6.5, 7, 8)
    assert decode_load(encode_load(load)) == load
    u = InflightUpdate("r0", InflightOp.PREFILLED, "req", "w", 3, 2)
    assert decode_inflight(encode_inflight(u)) == u


@pytest.mark.parametrize(
    "data",
    [
        b"\xc1garbage",
        msgpack.packb({"a": 1}),
        msgpack.packb([2, "w", 1, []]),  # unknown version
        msgpack.packb([1, "w", 1, [[9, 1]]]),  # unknown kind
        msgpack.packb([1, "w", 1, [[0, 1, None, [1, 2], [3]]]]),  # unequal arrays
        msgpack.packb([1, "w", 1, [[1, 1]]]),  # removed without hashes
        msgpack.packb([1, 5, 1, []]),  # worker id not a string
    ],
)
def test_garbage_raises_wire_error(data: bytes) -> None:
    with pytest.raises(WireError):
        decode_event_batch(data)


def test_bad_load_raises_wire_error() -> None:
    with pytest.raises(WireError, match="worker load"):
        decode_load(msgpack.packb([1, "w", "x", 2, 3, 4, 5, 6.0]))
    with pytest.raises(WireError, match="inflight"):
        decode_inflight(msgpack.packb([1, "r", 9, "q", "w", 0, 0]))


def test_cache_reset_reply_round_trips_and_refuses_bad_fields() -> None:
    r = CacheResetReply("prefill-1", "prefill", 12, 3)
    assert decode_cache_reset(encode_cache_reset(r)) == r
    for bad in ([1, "w", "decode", "x", 0], [1, 7, "decode", 1, 0], [1, "w", "decode", 1],
                [2, "w", "decode", 1, 0]):
        with pytest.raises(WireError, match="cache reset"):
            decode_cache_reset(msgpack.packb(bad))
