"""Worker side of load reporting: publish a ``WorkerLoad`` sample every ``interval_s``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import nats.errors

from services.api.wire import WorkerLoad, encode_load
from services.common.nats_client import NatsClient, Subjects
from services.common.service import cancel_and_wait

log = logging.getLogger(__name__)


async def publish_load(nc: NatsClient, subjects: Subjects, load: WorkerLoad) -> None:
    await nc.publish(subjects.load(load.worker_id), encode_load(load))


class LoadPublisher:
    """Owns a task that samples ``sample()`` and publishes it; close() stops it."""

    def __init__(
        self, nc: NatsClient, subjects: Subjects, sample: Callable[[], WorkerLoad], interval_s: float = 0.25
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self._nc, self._subjects, self._sample, self._interval = nc, subjects, sample, interval_s
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="load publisher")

    async def _run(self) -> None:
        while True:
            try:
                await publish_load(self._nc, self._subjects, self._sample())
            except (TimeoutError, nats.errors.Error) as e:
                log.warning("load publish failed: %s", e)
            await asyncio.sleep(self._interval)

    async def close(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
