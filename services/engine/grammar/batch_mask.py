"""The allowed-token bitmask of one batch: filled on the scheduler thread, applied to the
logits on the forward thread, handed over by an event.

With the overlapped loop, batch N+1 is launched before batch N's tokens are known, so its
mask cannot be filled at launch: once batch N is read back and its tokens have advanced
the matchers, the engine hands N+1's mask to the ``MaskFiller``'s thread and goes on with
the rest of the step while N+1's forward runs; the sampler of N+1 waits for the event
right before it masks (docs/engine.md "Constrained decoding"). A batch launched with
nothing in flight gets its mask before launch. Rows of requests without a grammar are not
in the mask and cost nothing; a batch with no grammar row has no mask.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import llguidance as llg
import torch

from services.engine.grammar.state import GrammarState
from services.engine.grammar.stats import GrammarStats

_SHIFTS: dict[torch.device, torch.Tensor] = {}


def _shifts(device: torch.device) -> torch.Tensor:
    t = _SHIFTS.get(device)
    if t is None:
        t = _SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    return t


def unpack_allowed(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """(R, W) int32 bitmask (bit ``t % 32`` of word ``t // 32`` = token t allowed) ->
    (R, vocab) bool."""
    allowed = (bits.unsqueeze(-1) >> _shifts(bits.device)) & 1  # (R, W, 32)
    return allowed.flatten(1)[:, :vocab].bool()


class BatchMask:
    """``rows[i]`` is the sample row (index among the batch's sampling sequences) that
    ``states[i]`` constrains; ``bits[i]`` its mask once ``ready`` is set."""

    __slots__ = ("rows", "states", "bits", "ready", "started", "_stats", "_rows_dev", "_all_rows")

    def __init__(self, rows: list[int], states: list[GrammarState], bits: torch.Tensor,
                 num_sample_rows: int, stats: GrammarStats) -> None:
        self.rows = rows
        self.states = states
        self.bits = bits  # (len(rows), W) int32 on the host, a view of a reused buffer
        self.ready = threading.Event()
        self.started = threading.Event()  # the fill is under way (set before ``ready``)
        self._stats = stats
        self._rows_dev: torch.Tensor | None = None
        self._all_rows = len(rows) == num_sample_rows

    def fill(self, executor: llg.LLExecutor) -> None:
        """Compute every row's mask from its matcher's state now, then set ``ready``. A
        row whose matcher is dead or allows nothing is all ones (any token: it is refused
        when advanced, which ends that request); never raises past ``ready``."""
        try:
            t0 = time.perf_counter()
            live = [(s.matcher, i) for i, s in enumerate(self.states) if not s.dead]
            bits = self.bits
            if len(live) < len(self.states):
                bits.fill_(-1)
            self.started.set()
            if live:
                # NOTE: llguidance releases the interpreter lock while it computes.
                executor.unsafe_compute_mask_ptr(live, bits.data_ptr(), bits.shape[1] * 4,
                                                 bits.shape[0])
                empty = (bits == 0).all(dim=1)
                if bool(empty.any()):
                    for i in empty.nonzero().flatten().tolist():
                        self.states[i].error = "the grammar allows no token here"
                        bits[i] = -1
            self._stats.mask_fill_seconds.observe(time.perf_counter() - t0)
        finally:
            self.started.set()
            self.ready.set()

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Wait for the mask, set every disallowed logit of the grammar rows to -inf. The
        caller's ``logits`` (N, V) may be modified in place."""
        if not self.ready.is_set():
            t0 = time.perf_counter()
            self.ready.wait()
            self._stats.mask_wait_seconds.observe(time.perf_counter() - t0)
        dev = logits.device
        bits = self.bits.to(dev, non_blocking=True) if dev.type != "cpu" else self.bits
        disallowed = ~unpack_allowed(bits, logits.shape[1])
        if self._all_rows:
            return logits.masked_fill_(disallowed, float("-inf"))
        if self._rows_dev is None or self._rows_dev.device != dev:
            self._rows_dev = torch.tensor(self.rows, dtype=torch.int64, device=dev)
        idx = self._rows_dev
        sub = logits.index_select(0, idx).masked_fill_(disallowed, float("-inf"))
        return logits.index_copy_(0, idx, sub)


class MaskBuilder:
    """Builds each batch's BatchMask over two reused host buffers (pinned for CUDA): a
    batch's mask is read by its sampler before the next-but-one batch's mask is filled."""

    def __init__(self, max_rows: int, vocab_size: int, pin: bool, stats: GrammarStats) -> None:
        words = (vocab_size + 31) // 32
        self._buffers = [torch.full((max_rows, words), -1, dtype=torch.int32, pin_memory=pin)
                         for _ in range(2)]
        self._turn = 0
        self._stats = stats

    def build(self, rows: Sequence[int], states: list[GrammarState],
              num_sample_rows: int) -> BatchMask:
        buf = self._buffers[self._turn]
        self._turn ^= 1
        return BatchMask(list(rows), states, buf[: len(rows)], num_sample_rows, self._stats)


class MaskFiller:
    """Fills masks on a thread of its own. Filled on the scheduler thread, a mask's fill is
    time the step's Python work waits for; here llguidance computes while that work goes
    on, and the sampler that needs the mask waits only for what is left of it."""

    def __init__(self, executor: llg.LLExecutor) -> None:
        self._executor = executor
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="engine-grammar")

    def start(self, mask: BatchMask) -> None:
        """Fill ``mask`` on the thread; return once the fill is under way. Its rows'
        matchers belong to the fill until ``mask.ready``."""
        self._thread.submit(mask.fill, self._executor)
        # NOTE: waiting hands the interpreter lock to the thread, which returns it when
        # llguidance starts computing, instead of at the next switch interval (5 ms).
        mask.started.wait()
