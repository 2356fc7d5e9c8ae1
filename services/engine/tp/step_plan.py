"""The per-step message: encoded from a ScheduledBatch on the entry rank, decoded back
into one on every other rank.

The entry remembers which block-table prefix each rank already holds per sequence (a
request's handle and choice), so a decode step usually carries no block ids at all, and
only a new block when it crosses one.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from services.api.sampling import SamplingParams
from services.engine.batch import ScheduledBatch, ScheduledSeq
from services.engine.tp.messages import RankRequest, SeqWork, StepMessage
from services.model.image_spans import ImageSpan

_NO_SAMPLING = SamplingParams(temperature=0.0)  # other ranks never sample


class StepEncoder:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        # handle -> choice -> the block table the ranks hold
        self._sent: dict[int, dict[int, list[int]]] = {}

    def forget(self, handle: int) -> None:
        self._sent.pop(handle, None)

    def encode(self, batch: ScheduledBatch, handles: dict[str, int], dropped: list[int],
               futures_base: int = 0, futures_count: int = 0) -> StepMessage:
        bs = self.block_size
        work = []
        for s, owner in zip(batch.seqs, batch.owners, strict=True):
            h = handles[s.request_id]
            used = (s.end_pos + bs - 1) // bs
            cur = s.block_ids
            tables = self._sent.setdefault(h, {})
            sent = tables.get(owner.choice)
            if sent is not None and cur[: len(sent)] == sent:
                keep = len(sent)
                new = cur[keep:used]
                sent.extend(new)
            else:  # first step, or the table was rebuilt (preemption)
                keep = 0
                new = cur[:used]
                tables[owner.choice] = list(new)
            n_prompt = owner.num_prompt_tokens
            generated = s.token_ids[max(0, n_prompt - s.start_pos):]
            work.append(SeqWork(h, owner.choice, s.start_pos, len(s.token_ids), n_prompt, generated,
                                keep, new))
        return StepMessage(work, dropped, futures_base, futures_count)


class StepDecoder:
    """Rebuilds the batch a rank computes; ``request(handle)`` blocks on that request's payload."""

    def __init__(self, request: Callable[[int], RankRequest], forget: Callable[[int], None]) -> None:
        self._request = request
        self._forget = forget
        self._tables: dict[int, dict[int, list[int]]] = {}  # handle -> choice -> block table
        self.wait_seconds = 0.0  # time spent blocked on payloads, cumulative

    def decode(self, msg: StepMessage) -> ScheduledBatch:
        for h in msg.dropped:
            self._tables.pop(h, None)
            self._forget(h)
        seqs = []
        for w in msg.seqs:
            table = self._tables.setdefault(w.handle, {}).setdefault(w.choice, [])
            del table[w.keep_blocks:]
            table.extend(w.new_blocks)
            images: tuple[ImageSpan, ...] = ()
            if w.start_pos < w.num_prompt:
                t0 = time.perf_counter()
                req = self._request(w.handle)
                self.wait_seconds += time.perf_counter() - t0
                tokens = req.prompt[w.start_pos : min(w.start_pos + w.num_tokens, w.num_prompt)] + w.generated
                images = req.images
            else:
                tokens = w.generated
            seqs.append(ScheduledSeq(str(w.handle), tokens, w.start_pos, table, False, _NO_SAMPLING,
                                     images=images))
        return ScheduledBatch(seqs)
