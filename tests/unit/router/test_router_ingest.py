"""Ingest rules without NATS: in-order apply, replays skipped, gaps and restarts detected."""

from __future__ import annotations

from services.api.kv_events import KvCleared, KvRemoved, KvStored, StoredBlock
from services.api.wire import decode_event_batch_raw, encode_event_batch
from services.common.hashing import block_hashes
from services.common.nats_client import Subjects
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


def _ignored(metrics: RouterMetrics, reason: str, kind: str = "kv_events") -> float:
    return metrics.registry.get_sample_value(
        "tandem_router_events_ignored_total", {"kind": kind, "reason": reason}) or 0.0


def test_batches_of_a_worker_not_admitted_are_dropped_and_counted() -> None:
    ing, index, metrics = _ingest()
    for sid in (1, 2):  # no state is kept for it, whatever the session
        ing.handle_batch(decode_event_batch_raw(encode_event_batch(
            "forged", sid, [KvStored("forged", 1, None, _stored(1, [3] * 40).blocks)])))
    assert index.num_blocks() == 0 and not ing.admitted("forged") and ing.buffered_blocks() == 0
    assert _ignored(metrics, "unregistered") == 2
    assert metrics.registry.get_sample_value("tandem_router_indexed_blocks") is not None


def test_stored_blocks_past_the_bound_are_refused_not_gaps_until_cleared() -> None:
    index, metrics = RadixIndex(), RouterMetrics()
    ing = KvIngest(None, Subjects("t"), index, metrics, dump_timeout_s=1, max_buffered_batches=4,
                   max_blocks_per_worker=5)
    ing.mark_synced("w", session=9)
    e1 = _stored(1, [1] * 16)  # 4 blocks
    e2 = _stored(2, [2] * 8)  # 2 more: past 5, refused whole
    e3 = _stored(3, [4] * 4, parent=e2.blocks[-1].seq_hash)  # after a refused block
    e4 = _stored(4, [5] * 4)  # 1 more: fits
    _feed(ing, 9, [e1, e2, e3, e4])
    assert index.num_blocks("w") == 5 and ing.last_event_id("w") == 4 and ing.synced("w")
    assert _ignored(metrics, "over_limit") == 2 and metrics.gaps._value.get() == 0
    _feed(ing, 9, [KvCleared("w", 5), _stored(6, [2] * 8)])  # room again
    assert index.num_blocks("w") == 2
    # Once cleared, an unknown parent is a gap again (not a refusal).
    _feed(ing, 9, [_stored(7, [6] * 4, parent=12345)])
    assert metrics.gaps._value.get() == 1 and _ignored(metrics, "over_limit") == 2
    index.check_integrity()


def test_the_sync_buffer_is_bounded_in_blocks_too() -> None:
    index, metrics = RadixIndex(), RouterMetrics()
    ing = KvIngest(None, Subjects("t"), index, metrics, dump_timeout_s=1, max_buffered_batches=100,
                   max_blocks_per_worker=10)
    ing.worker_joined("w")  # no NATS: the sync waits, batches are buffered
    _feed(ing, 9, [_stored(1, [1] * 32)])  # 8 blocks
    assert ing.buffered_blocks() == 8
    _feed(ing, 9, [_stored(2, [2] * 12)])  # 3 more: past 10, the buffer is dropped
    assert ing.buffered_blocks() == 0 and index.num_blocks() == 0
    ing.worker_left("w")
    assert not ing.admitted("w")
