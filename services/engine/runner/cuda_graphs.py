"""CUDA graphs of the decode-only step: the forward and the LM head of a batch of single-token
sequences, captured once per (batch size, context) bucket at start-up and replayed instead
of launching the step's ~15 kernels per layer one by one from Python.

A graph has fixed shapes, so a batch of ``n`` sequences whose longest context spans ``nb``
KV blocks runs in the smallest captured bucket ``(B >= n, NB >= nb)``: rows past ``n`` are
padding (token 0 at position 0, attending to one slot, writing its K/V to a scratch block
past the pool's own, so no real block is touched), block-table columns past a sequence's
own blocks are block 0 and masked out. Batch buckets are 1, 2, 4, ... up to
``max_num_seqs``; context buckets double from ``MIN_CONTEXT_BLOCKS`` blocks up to
``max_context`` tokens. A step that is not decode-only, or larger than every bucket, runs
eagerly, as does everything on CPU (the runner makes no ``DecodeGraphs`` there).

Every graph reads its inputs from one packed int64 buffer (token ids, positions, cache
slots, context lengths, block table), filled with a single host-to-device copy per step;
placeholders of the overlapped loop are resolved into it on the device before replay.
The graphs share one memory pool: a replay's logits are valid until the next replay,
which the forward thread only starts after sampling them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from services.engine.batch import ScheduledBatch
from services.engine.layers.attention import AttentionMetadata, DecodeGroup, TokenRows
from services.engine.model import LlamaModel

log = logging.getLogger(__name__)

MIN_CONTEXT_BLOCKS = 16


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, ... below ``max_num_seqs``, then ``max_num_seqs`` itself."""
    out, b = [], 1
    while b < max_num_seqs:
        out.append(b)
        b *= 2
    return [*out, max_num_seqs]


def context_buckets(max_context: int, block_size: int) -> list[int]:
    """Block counts: ``MIN_CONTEXT_BLOCKS`` doubling, the last one covering ``max_context``."""
    top = -(-max_context // block_size)
    out, nb = [], min(MIN_CONTEXT_BLOCKS, top)
    while nb < top:
        out.append(nb)
        nb *= 2
    return [*out, top]


def _smallest_at_least(buckets: Sequence[int], n: int) -> int | None:
    return next((b for b in buckets if b >= n), None)


@dataclass(slots=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    packed: torch.Tensor  # (4 * B + B * NB,) int64: ids, positions, slots, ctx_len, table
    logits: torch.Tensor  # (B, V): the graph's output


class DecodeGraphs:
    """The captured decode graphs of one runner. ``scratch_slot`` is a KV slot outside the
    block pool (the runner allocates one extra block) where padding rows write."""

    def __init__(self, model: LlamaModel, kv_layers: list[torch.Tensor], block_size: int,
                 max_num_seqs: int, max_context: int, scratch_slot: int,
                 device: torch.device, per_token: bool = False) -> None:
        self.model = model
        self.kv_layers = kv_layers
        self.block_size = block_size
        self.batch_sizes = batch_buckets(max_num_seqs)
        self.context_blocks = context_buckets(max_context, block_size)
        self.scratch_slot = scratch_slot
        self.device = device
        self.dtype = kv_layers[0].dtype
        self.per_token = per_token  # TokenRows metadata: the batch-invariant kernels' (engine.deterministic)
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self.replays = 0  # decode steps served by a graph (tests and the bench read it)

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    # -- capture ----------------------------------------------------------------------------

    def capture(self, progress: Callable[[str], None] | None = None) -> None:
        """Capture every bucket, largest first (smaller graphs then reuse its pool)."""
        keys = [(b, nb) for b in reversed(self.batch_sizes) for nb in reversed(self.context_blocks)]
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for i, (b, nb) in enumerate(keys):
                self._graphs[(b, nb)] = self._capture_one(b, nb, pool)
                if progress is not None and (i + 1 == len(keys) or (i + 1) % 8 == 0):
                    progress(f"captured {i + 1}/{len(keys)} decode CUDA graphs "
                             f"(batch up to {self.batch_sizes[-1]}, context up to "
                             f"{self.context_blocks[-1] * self.block_size} tokens)")
        torch.cuda.synchronize(self.device)

    def _capture_one(self, b: int, nb: int, pool: object) -> _Graph:
        packed = torch.zeros(4 * b + b * nb, dtype=torch.int64, device=self.device)
        self._stage(ScheduledBatch(), (b, nb), packed, packed)  # every row padding

        def body() -> torch.Tensor:
            return self._forward(packed, b, nb)

        # Warm-up on a side stream (cuBLAS handles, SDPA kernel choice), as capture needs.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                body()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits = body()
        return _Graph(graph, packed, logits)

    def _forward(self, packed: torch.Tensor, b: int, nb: int) -> torch.Tensor:
        ids, positions, slots, ctx_len = packed[: 4 * b].view(4, b)
        table = packed[4 * b :].view(b, nb)
        if self.per_token:
            meta = AttentionMetadata(slot_mapping=slots, num_prefill_tokens=0,
                                     token_rows=TokenRows(block_table=table, ctx_len=ctx_len))
        else:
            pos = torch.arange(nb * self.block_size, device=self.device)
            keep = pos[None, :] < ctx_len[:, None]  # (B, L)
            mask = torch.zeros(keep.shape, dtype=self.dtype, device=self.device)
            mask = mask.masked_fill(~keep, float("-inf"))[:, None, None, :]
            meta = AttentionMetadata(slot_mapping=slots, num_prefill_tokens=0,
                                     decode=DecodeGroup(block_table=table, mask=mask))
        hidden = self.model(ids, positions, meta, self.kv_layers)  # (B, H)
        return self.model.compute_logits(hidden)  # (B, V)

    # -- replay -----------------------------------------------------------------------------

    def bucket(self, batch: ScheduledBatch) -> tuple[int, int] | None:
        """The bucket a decode-only ``batch`` replays in; None: run it eagerly."""
        seqs = batch.seqs
        if not seqs or any(len(s.token_ids) != 1 for s in seqs):
            return None
        b = _smallest_at_least(self.batch_sizes, len(seqs))
        nb = _smallest_at_least(self.context_blocks,
                                max(s.start_pos for s in seqs) // self.block_size + 1)
        if b is None or nb is None:
            return None
        return b, nb

    def run(self, batch: ScheduledBatch, key: tuple[int, int], future: torch.Tensor) -> torch.Tensor:
        """Logits (n, V) of the decode-only ``batch`` (every row, batch order), from the
        graph of ``key`` (``bucket(batch)``). Placeholder ids are resolved from ``future``.
        The logits are the graph's output buffer: valid until the next replay."""
        g = self._graphs[key]
        self._stage(batch, key, future, g.packed)
        g.graph.replay()
        self.replays += 1
        return g.logits[: len(batch.seqs)]

    def padded_forward(self, batch: ScheduledBatch, key: tuple[int, int],
                       future: torch.Tensor) -> torch.Tensor:
        """What a replay of ``key`` computes, run eagerly on any device (no capture): the
        padding and packing checked where there is no GPU."""
        b, nb = key
        packed = torch.empty(4 * b + b * nb, dtype=torch.int64, device=self.device)
        self._stage(batch, key, future, packed)
        return self._forward(packed, b, nb)[: len(batch.seqs)]

    def _stage(self, batch: ScheduledBatch, key: tuple[int, int], future: torch.Tensor,
               packed: torch.Tensor) -> None:
        """Fill ``packed`` for ``batch`` padded to ``key``, with one host-to-device copy."""
        b, nb = key
        seqs = batch.seqs
        bs = self.block_size
        pad = b - len(seqs)
        ids = [s.token_ids[0] for s in seqs]
        positions = [s.start_pos for s in seqs]
        slots = [s.block_ids[p // bs] * bs + p % bs for s, p in zip(seqs, positions, strict=True)]
        table: list[int] = []
        for s, p in zip(seqs, positions, strict=True):
            used = p // bs + 1
            table += s.block_ids[:used]
            table += [0] * (nb - used)
        host = torch.tensor(
            ids + [0] * pad + positions + [0] * pad + slots + [self.scratch_slot] * pad
            + [p + 1 for p in positions] + [1] * pad + table + [0] * (pad * nb),
            dtype=torch.int64,
        )
        if packed.device.type == "cuda":
            packed.copy_(host.pin_memory(), non_blocking=True)
        else:
            packed.copy_(host)
        if ids and min(ids) < 0:  # tokens the previous batch is sampling: read on the device
            dev_ids = packed[:b]
            dev_ids.copy_(torch.where(dev_ids < 0, future[(-1 - dev_ids).clamp(min=0)], dev_ids))
