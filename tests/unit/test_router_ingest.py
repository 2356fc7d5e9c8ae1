"""Ingest rules without NATS: in-order apply, replays skipped, gaps and restarts detected."""

from __future__ import annotations

from services.common.hashing import block_hashes
from services.common.kv_events import KvCleared, KvRemoved, KvStored, StoredBlock
from services.common.nats_client import Subjects
from services.common.wire import decode_event_batch_raw, encode_event_batch
from services.router.indexer import RadixIndex
from services.router.ingest import KvIngest
from services.router.metrics import RouterMetrics


def _stored(eid: int, tokens: list[int], parent: int | None = None) -> KvStored:
    blocks = tuple(StoredBlock(b.seq_hash, b.local_hash) for b in block_hashes(tokens, 4, parent))
    return KvStored("w", eid, parent, blocks)


def _ingest() -> tuple[KvIngest, RadixIndex, RouterMetrics]:
    index, metrics = RadixIndex(), RouterMetrics()
    ing = KvIngest(None, Subjects("t"), index, metrics, dump_timeout_s=1, max_buffered_batches=4)
    ing.mark_synced("w", session=9)
    return ing, index, metrics


def _feed(ing: KvIngest, session: int, events: list) -> None:
    ing.handle_batch(decode_event_batch_raw(encode_event_batch("w", session, events)))


def test_in_order_events_apply_and_replays_are_skipped() -> None:
    ing, index, metrics = _ingest()
    e1 = _stored(1, [1] * 8)
    e2 = _stored(2, [2] * 4, parent=e1.blocks[-1].seq_hash)
    _feed(ing, 9, [e1, e2])
    assert index.num_blocks("w") == 3 and ing.last_event_id("w") == 2
    _feed(ing, 9, [e1, e2, KvRemoved("w", 3, (e2.blocks[0].seq_hash,))])  # 1, 2 replayed
    assert index.num_blocks("w") == 2 and ing.last_event_id("w") == 3
    _feed(ing, 9, [KvCleared("w", 4)])
    assert index.num_blocks("w") == 0
    assert metrics.events_applied._value.get() == 4 and metrics.gaps._value.get() == 0


def test_gap_and_new_session_stop_applying_until_synced() -> None:
    ing, index, metrics = _ingest()
    _feed(ing, 9, [_stored(1, [1] * 4)])
    _feed(ing, 9, [_stored(3, [3] * 4)])  # id 2 missing
    assert metrics.gaps._value.get() == 1
    assert index.num_blocks("w") == 1 and not ing.synced("w")  # no NATS: sync waits
    ing2, index2, _ = _ingest()
    _feed(ing2, 10, [_stored(1, [1] * 4)])  # another session: the worker restarted
    assert index2.num_blocks("w") == 0 and not ing2.synced("w")


def test_stored_after_unknown_parent_is_a_gap() -> None:
    ing, index, metrics = _ingest()
    _feed(ing, 9, [_stored(1, [5] * 4, parent=12345)])
    assert metrics.gaps._value.get() == 1 and index.num_blocks() == 0
