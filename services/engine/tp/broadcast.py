"""Request payloads from the entry rank to the others, off the step thread.

Entry side (``PayloadBroadcaster``): ``async`` queues the payload for a background thread
that serialises it (copying the image embeddings' bytes there too) and sends it, so the
step thread never waits on a slow rank or a large prompt; ``sync`` sends on the caller's
thread and waits for every rank's acknowledgement (the synchronous broadcast, kept to
measure the asynchronous one against). ``cancel`` drops a payload that has not left yet
(an abort).

Rank side (``PayloadReceiver``): a thread receives payloads, materialises the prompt and
the image embeddings and completes that request's future; the step loop waits on a
future only in the step that first needs the prompt.
"""

from __future__ import annotations

import logging
import pickle
import queue
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from multiprocessing.connection import Connection

from services.engine.tp.messages import RankRequest, RequestPayload
from services.model.image_spans import ImageSpan

log = logging.getLogger(__name__)

_ACK = b"k"


@dataclass(frozen=True, slots=True)
class _Item:
    handle: int
    prompt: list[int]
    images: tuple[ImageSpan, ...]
    extras: bytes


class BroadcastError(RuntimeError):
    """A rank did not take a payload within the timeout, or its pipe broke."""


class PayloadBroadcaster:
    def __init__(self, conns: list[Connection], mode: str, timeout_s: float) -> None:
        self._conns = conns
        self.sync = mode == "sync"
        self.timeout_s = timeout_s
        self.blocked_seconds = 0.0  # the caller's time in submit, cumulative
        self.sent = 0
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._pending: set[int] = set()
        self._cancelled: set[int] = set()
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        if not self.sync:
            self._thread = threading.Thread(target=self._run, name="tp-broadcast", daemon=True)
            self._thread.start()

    def submit(self, handle: int, prompt_token_ids: list[int], images: tuple[ImageSpan, ...] = (),
               extras: bytes = b"") -> None:
        t0 = time.perf_counter()
        item = _Item(handle, prompt_token_ids, images, extras)
        if self.sync:
            self._send(item)
            self._await_acks(handle)
        else:
            if self.error is not None:
                raise BroadcastError(f"tensor-parallel payload broadcast failed: {self.error!r}")
            with self._lock:
                self._pending.add(handle)
            self._queue.put(item)
        self.blocked_seconds += time.perf_counter() - t0

    def cancel(self, handle: int) -> None:
        with self._lock:
            if handle in self._pending:
                self._pending.discard(handle)
                self._cancelled.add(handle)

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=self.timeout_s)

    def _send(self, item: _Item) -> None:
        payload = RequestPayload.of(item.handle, item.prompt, item.images, item.extras)
        data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
        for c in self._conns:
            c.send_bytes(data)
        self.sent += 1

    def _await_acks(self, handle: int) -> None:
        for rank, c in enumerate(self._conns, start=1):
            if not c.poll(self.timeout_s):
                raise BroadcastError(f"rank {rank} did not acknowledge the payload of request "
                                     f"handle {handle} within {self.timeout_s}s")
            c.recv_bytes()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            with self._lock:
                if item.handle in self._cancelled:
                    self._cancelled.discard(item.handle)
                    continue
                self._pending.discard(item.handle)
            try:
                self._send(item)
            except (OSError, ValueError) as e:  # a dead rank: the forward reports it too
                log.error("tensor-parallel payload broadcast failed: %r", e)
                self.error = e
                return


class PayloadReceiver:
    def __init__(self, conn: Connection, sync: bool, timeout_s: float) -> None:
        self._conn = conn
        self._sync = sync
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._futures: dict[int, Future[RankRequest]] = {}
        self._dropped: set[int] = set()  # dropped before their payload arrived
        self._thread = threading.Thread(target=self._run, name="tp-payloads", daemon=True)
        self._thread.start()

    def _future(self, handle: int) -> Future[RankRequest]:
        with self._lock:
            fut = self._futures.get(handle)
            if fut is None:
                fut = self._futures[handle] = Future()
            return fut

    def request(self, handle: int) -> RankRequest:
        """The prompt and images of ``handle``, waiting for its payload if it has not arrived yet."""
        try:
            return self._future(handle).result(timeout=self.timeout_s)
        except FutureTimeout:
            raise BroadcastError(f"the payload of request handle {handle} did not arrive within "
                                 f"{self.timeout_s}s") from None

    def forget(self, handle: int) -> None:
        with self._lock:
            fut = self._futures.pop(handle, None)
            if fut is None or not fut.done():
                self._dropped.add(handle)

    @property
    def num_live(self) -> int:
        return len(self._futures)

    def _run(self) -> None:
        while True:
            try:
                data = self._conn.recv_bytes()
            except (EOFError, OSError):
                return  # the entry is gone; the step loop sees it too
            payload: RequestPayload = pickle.loads(data)
            inputs = payload.materialise()
            with self._lock:
                if payload.handle in self._dropped:
                    # Payloads leave in handle order: a dropped handle below this one was
                    # cancelled before it left and never arrives.
                    self._dropped = {d for d in self._dropped if d > payload.handle}
                    fut = None
                else:
                    if self._dropped:
                        self._dropped = {d for d in self._dropped if d > payload.handle}
                    fut = self._futures.get(payload.handle)
                    if fut is None:
                        fut = self._futures[payload.handle] = Future()
            if fut is not None:
                fut.set_result(inputs)
            if self._sync:
                self._conn.send_bytes(_ACK)
