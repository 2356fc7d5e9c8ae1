"""Per-worker load as the router sees it: the worker's metrics merged with what the
routers sent it and have not yet seen finish.

Workers publish ``WorkerLoad`` a few times a second, so a burst of requests routed between
two samples would all see the same (idle) numbers. The tracker therefore also counts, per
worker, the requests routed to it and not yet finished ("in flight"): each holds its prompt
blocks as active KV, and its uncached prompt blocks as pending prefill until its first token.
Router replicas share these adds and frees over NATS, so they all see the same in-flight set.

Merging rule: the metrics already include the requests we routed once the worker reports
them, so adding the two would double-count; the tracker takes the larger of the two:

    active_blocks(w)   = max(inflight_prompt_blocks(w), metrics.kv_blocks_used)
    pending_prefill(w) = max(inflight_prefill_blocks(w), ceil(metrics.active_prefill_tokens / block_size))

Metrics older than ``load_stale_s`` are ignored; in-flight entries older than
``inflight_ttl_s`` are dropped (their free was lost).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from services.api.wire import WorkerLoad


@dataclass(slots=True)
class _Inflight:
    worker_id: str
    prompt_blocks: int
    prefill_blocks: int  # 0 once the first token is out
    added_at: float


@dataclass(frozen=True, slots=True)
class LoadView:
    pending_prefill_blocks: int
    active_blocks: int


class LoadTracker:
    def __init__(
        self,
        block_size: int,
        inflight_ttl_s: float,
        load_stale_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self._block_size = block_size
        self._ttl = inflight_ttl_s
        self._stale = load_stale_s
        self._clock = clock
        self._metrics: dict[str, tuple[WorkerLoad, float]] = {}
        self._inflight: OrderedDict[str, _Inflight] = OrderedDict()
        self._prompt_sum: dict[str, int] = {}
        self._prefill_sum: dict[str, int] = {}
        self._count: dict[str, int] = {}  # in-flight requests per worker

    # ---- inputs ----------------------------------------------------------------------
    def update_metrics(self, load: WorkerLoad) -> None:
        self._metrics[load.worker_id] = (load, self._clock())

    def add(self, request_id: str, worker_id: str, prompt_blocks: int, prefill_blocks: int) -> None:
        """A request was routed to ``worker_id``; adding a known request id is a no-op."""
        self._expire()
        if request_id in self._inflight:
            return
        self._inflight[request_id] = _Inflight(worker_id, prompt_blocks, prefill_blocks, self._clock())
        self._prompt_sum[worker_id] = self._prompt_sum.get(worker_id, 0) + prompt_blocks
        self._count[worker_id] = self._count.get(worker_id, 0) + 1
        self._prefill_sum[worker_id] = self._prefill_sum.get(worker_id, 0) + prefill_blocks

    def prefilled(self, request_id: str) -> None:
        """The request's first token is out: its prefill no longer loads the worker."""
        e = self._inflight.get(request_id)
        if e is not None and e.prefill_blocks:
            self._prefill_sum[e.worker_id] -= e.prefill_blocks
            e.prefill_blocks = 0

    def free(self, request_id: str) -> None:
        """The request finished (or was aborted); unknown ids are ignored."""
        e = self._inflight.pop(request_id, None)
        if e is not None:
            self._drop(e)

    def remove_worker(self, worker_id: str) -> None:
        self._metrics.pop(worker_id, None)
        for rid in [r for r, e in self._inflight.items() if e.worker_id == worker_id]:
            del self._inflight[rid]
        self._prompt_sum.pop(worker_id, None)
        self._prefill_sum.pop(worker_id, None)
        self._count.pop(worker_id, None)

    def _drop(self, e: _Inflight) -> None:
        self._prompt_sum[e.worker_id] -= e.prompt_blocks
        self._prefill_sum[e.worker_id] -= e.prefill_blocks
        self._count[e.worker_id] -= 1

    def _expire(self) -> None:
        # Insertion order is age order, so expiry only looks at the front.
        horizon = self._clock() - self._ttl
        while self._inflight:
            rid, e = next(iter(self._inflight.items()))
            if e.added_at > horizon:
                break
            del self._inflight[rid]
            self._drop(e)

    # ---- outputs ---------------------------------------------------------------------
    def view(self, worker_id: str) -> LoadView:
        """``(pending_prefill_blocks, active_blocks)``: the first two fields of ``ttft_views``."""
        return LoadView(*self.ttft_views([worker_id])[0][:2])

    def ttft_views(self, worker_ids: list[str]) -> list[tuple[int, int, int, int]]:
        """``(pending_prefill_blocks, active_blocks, running, free_blocks)`` per worker, by the
        merging rule in the module docstring, in one pass with hoisted lookups because the
        router calls it for every worker per route. ``running``: the sequences that will decode
        beside a new request's prefill, the larger of the worker's reported running + waiting
        requests and the in-flight ones (those queued ahead are prefilled first, then decode);
        ``free_blocks``: the worker's KV blocks less ``active_blocks`` (-1 without fresh
        metrics)."""
        now = self._clock()
        stale, bs = self._stale, self._block_size
        prompt_sum, prefill_sum, metrics = self._prompt_sum, self._prefill_sum, self._metrics
        count = self._count
        out = []
        for w in worker_ids:
            prompt = prompt_sum.get(w, 0)
            prefill = prefill_sum.get(w, 0)
            running = count.get(w, 0)
            free = -1
            m = metrics.get(w)
            if m is not None and now - m[1] <= stale:
                load = m[0]
                if load.kv_blocks_used > prompt:
                    prompt = load.kv_blocks_used
                p = -(-load.active_prefill_tokens // bs)
                if p > prefill:
                    prefill = p
                reported = load.requests_running + load.requests_waiting
                if reported > running:
                    running = reported
                free = max(load.kv_blocks_total - prompt, 0)
            out.append((prefill, prompt, running, free))
        return out

    def inflight_count(self, worker_id: str | None = None) -> int:
        if worker_id is None:
            return len(self._inflight)
        return self._count.get(worker_id, 0)

    def metrics(self, worker_id: str) -> WorkerLoad | None:
        m = self._metrics.get(worker_id)
        return m[0] if m is not None else None
