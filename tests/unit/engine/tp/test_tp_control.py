"""The TP control plane without processes: payloads cancelled before they leave never do,
a rank forgets a dropped request whether its payload came before or after, and the step
message carries block-table changes only."""

from __future__ import annotations

import pickle
import threading
from multiprocessing import Pipe

import torch

from services.engine.batch import ScheduledBatch
from services.engine.request import GenerateRequest
from services.engine.sequence import Sequence
from services.engine.tp.broadcast import PayloadBroadcaster, PayloadReceiver
from services.engine.tp.messages import RankRequest, RequestPayload
from services.engine.tp.step_plan import StepDecoder, StepEncoder
from services.model.image_spans import ImageSpan
from tests.support.tiny_model import seq


class _GatedConn:
    """Records what is sent; the first send blocks until ``gate`` is set."""

    def __init__(self) -> None:
        self.sent: list[int] = []
        self.entered = threading.Event()
        self.gate = threading.Event()

    def send_bytes(self, data: bytes) -> None:
        self.entered.set()
        self.gate.wait(10)
        self.sent.append(pickle.loads(data).handle)


def test_cancel_drops_a_payload_that_has_not_left() -> None:
    conn = _GatedConn()
    b = PayloadBroadcaster([conn], "async", timeout_s=10)  # type: ignore[list-item]
    b.submit(0, [1, 2])
    assert conn.entered.wait(10)  # the thread is sending payload 0
    b.submit(1, [3])
    b.submit(2, [4])
    b.cancel(1)  # an abort while it waits its turn
    conn.gate.set()
    b.close()
    assert conn.sent == [0, 2]


def test_sync_submit_waits_for_every_rank() -> None:
    here, there = Pipe()
    receiver = PayloadReceiver(there, sync=True, timeout_s=10)
    b = PayloadBroadcaster([here], "sync", timeout_s=10)
    b.submit(7, [5, 6, 7], extras=b"raw")
    assert b.sent == 1
    assert receiver.request(7).prompt == [5, 6, 7]  # already there: submit returned after the ack


def test_receiver_forgets_dropped_requests_in_any_order() -> None:
    here, there = Pipe()
    receiver = PayloadReceiver(there, sync=True, timeout_s=10)

    def send(h: int, ids: list[int]) -> None:
        here.send_bytes(pickle.dumps(RequestPayload.of(h, ids)))
        assert here.poll(10)
        here.recv_bytes()  # the ack: the payload was handled

    send(0, [1])
    receiver.forget(0)  # dropped after its payload came
    receiver.forget(1)  # dropped before (it was cancelled, or is still on its way)
    send(1, [2])
    receiver.forget(2)  # cancelled on the entry: never sent
    send(3, [3])  # a later handle: 2 will never come
    assert receiver.num_live == 1 and receiver.request(3).prompt == [3]
    assert receiver._dropped == set()


def test_step_message_carries_block_table_changes_only() -> None:
    owner = Sequence.from_request(GenerateRequest("a", list(range(10, 17))))
    handles = {"a": 0}
    prompts = {0: RankRequest(list(range(10, 17)))}
    enc = StepEncoder(block_size=4)
    dec = StepDecoder(prompts.__getitem__, lambda h: None)

    def roundtrip(s):
        msg = enc.encode(ScheduledBatch([s], [owner]), handles, [])
        return msg, dec.decode(pickle.loads(pickle.dumps(msg))).seqs[0]

    msg, got = roundtrip(seq("a", list(range(10, 17)), 0, [3, 8]))  # prefill
    assert (msg.seqs[0].keep_blocks, msg.seqs[0].new_blocks, msg.seqs[0].generated) == (0, [3, 8], [])
    assert got.token_ids == list(range(10, 17)) and got.block_ids == [3, 8] and not got.sample
    msg, got = roundtrip(seq("a", [99], 7, [3, 8]))  # a decode inside block 8: nothing new
    assert (msg.seqs[0].keep_blocks, msg.seqs[0].new_blocks, msg.seqs[0].generated) == (2, [], [99])
    assert got.token_ids == [99] and got.start_pos == 7
    msg, got = roundtrip(seq("a", [98], 8, [3, 8, 5]))  # crosses into a new block
    assert (msg.seqs[0].keep_blocks, msg.seqs[0].new_blocks) == (2, [5])
    assert got.block_ids == [3, 8, 5]
    # Preempted and recomputed into other blocks: prompt from the payload, the generated
    # tokens from the message, the table resent whole.
    msg, got = roundtrip(seq("a", list(range(10, 17)) + [99, 98], 0, [6, 2, 4]))
    assert (msg.seqs[0].keep_blocks, msg.seqs[0].new_blocks, msg.seqs[0].generated) == (0, [6, 2, 4], [99, 98])
    assert got.token_ids == list(range(10, 17)) + [99, 98] and got.block_ids == [6, 2, 4]


def test_image_embeddings_cross_in_their_dtype() -> None:
    embeds = torch.randn(3, 8).to(torch.bfloat16)
    span = ImageSpan(2, 3, "ab" * 32, embeds)
    payload = pickle.loads(pickle.dumps(RequestPayload.of(0, [1, 2, 9, 9, 9, 3], (span,))))
    assert len(payload.images[0].embeds) == 3 * 8 * 2  # two bytes a value: not widened
    got = payload.materialise()
    assert got.prompt == [1, 2, 9, 9, 9, 3]
    (image,) = got.images
    assert (image.offset, image.length, image.content_hash) == (2, 3, "ab" * 32)
    assert image.embeds is not None and image.embeds.dtype == torch.bfloat16
    assert torch.equal(image.embeds, embeds)
    # A rank's prefill chunk carries the images; its decode steps need none.
    owner = Sequence.from_request(GenerateRequest("a", got.prompt, images=(span,)))
    enc, dec = StepEncoder(block_size=4), StepDecoder({0: got}.__getitem__, lambda h: None)
    prefill = dec.decode(enc.encode(ScheduledBatch([seq("a", got.prompt, 0, [3, 8])], [owner]), {"a": 0}, []))
    assert prefill.seqs[0].images is got.images
    decode = dec.decode(enc.encode(ScheduledBatch([seq("a", [7], 6, [3, 8])], [owner]), {"a": 0}, []))
    assert decode.seqs[0].images == ()

