"""Reusable receive buffers for large transfers (KV, image embeddings over gRPC).

A fresh multi-hundred-MB ``torch.empty`` is backed by untouched pages: the first write to
each 4 KiB page faults, and on the bench machine that alone halved the receive copy rate
(~0.9 GB/s into a fresh buffer, ~2.5 GB/s into a reused one). The decode worker imports the
received KV into its cache and then hands the buffer back; an image's embeddings that came
whole keep their buffer as the image's tensor, lent (``lend``) until the last view of it is
gone. So the next transfer of a similar size writes into pages that are already mapped.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque

import torch


class ByteBufferPool:
    """Byte buffers kept for reuse, at most ``max_bytes`` of them idle. Thread-safe.

    ``take(n)`` returns a uint8 tensor of exactly ``n`` bytes (a view of a pooled buffer of
    at least ``n``, or a new one); ``give(t)`` returns it once nothing reads it any more.
    A buffer never given back is simply freed by the garbage collector.
    """

    def __init__(self, max_bytes: int = 1 << 30) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._idle: list[torch.Tensor] = []  # base buffers, uint8, 1-D
        # NOTE: lent buffers come back here, not through ``give``: their finalizer runs in
        # whatever code drops the last view, which may be this pool's own code holding the
        # lock (a garbage collection inside ``take``). A deque's append needs no lock;
        # the next call under the lock keeps them.
        self._returned: deque[torch.Tensor] = deque()
        self._lock = threading.Lock()

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            self._reclaim()
            return sum(b.numel() for b in self._idle)

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            self._reclaim()
            fits = [i for i, b in enumerate(self._idle) if b.numel() >= nbytes]
            if fits:
                # NOTE: by index: list.remove would compare tensors with == (elementwise).
                best = self._idle.pop(min(fits, key=lambda i: self._idle[i].numel()))
                return best[:nbytes]
        return torch.empty(nbytes, dtype=torch.uint8)

    def lend(self, nbytes: int) -> torch.Tensor:
        """Like ``take``, but the buffer comes back by itself once the returned tensor and
        every view of it are gone: for a receiver that keeps it as the payload's own tensor."""
        buf = self.take(nbytes)
        # NOTE: through numpy because a torch storage cannot carry a callback: the array
        # owns the returned tensor's storage, so it dies with the last view.
        arr = buf.numpy()
        weakref.finalize(arr, self._returned.append, buf)
        return torch.from_numpy(arr)

    def give(self, buf: torch.Tensor) -> None:
        base = buf._base if buf._base is not None else buf
        if base.dtype != torch.uint8 or base.dim() != 1:
            raise ValueError("give() takes a buffer from take()")
        with self._lock:
            self._reclaim()
            self._keep(base)

    def _reclaim(self) -> None:
        """Keep the lent buffers that came back (call holding the lock)."""
        while self._returned:
            buf = self._returned.popleft()
            self._keep(buf._base if buf._base is not None else buf)

    def _keep(self, base: torch.Tensor) -> None:
        """Add ``base`` to the idle set (call holding the lock)."""
        if any(b is base for b in self._idle):
            return
        self._idle.append(base)
        # NOTE: keep the largest (they fit the most requests); drop the rest past the cap.
        self._idle.sort(key=lambda b: b.numel(), reverse=True)
        total = 0
        kept = []
        for b in self._idle:
            if total + b.numel() <= self.max_bytes:
                kept.append(b)
                total += b.numel()
        self._idle = kept
