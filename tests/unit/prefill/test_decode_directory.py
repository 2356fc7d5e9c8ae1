"""Where a prefill worker may send KV: only the address discovery lists for the job's decode
worker, waiting a bounded time for a registration that has not arrived yet."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from services.common.discovery import Registration
from services.prefill.decode_directory import DecodeDirectory, Unlisted

pytestmark = pytest.mark.asyncio

A = Registration("decode", "decode-0", address="10.0.0.1:9300")


async def test_only_the_listed_address_of_that_worker_passes() -> None:
    d = DecodeDirectory()
    d.joined(A)
    d.joined(Registration("decode", "decode-1", address="10.0.0.2:9300"))
    assert d.check("decode-0", "10.0.0.1:9300") is None
    assert d.check("decode-0", "10.0.0.2:9300") is Unlisted.ADDRESS_MISMATCH  # decode-1's
    assert d.check("decode-0", "") is Unlisted.ADDRESS_MISMATCH
    assert d.check("decode-9", "10.0.0.1:9300") is Unlisted.UNKNOWN_WORKER
    d.left("decode-0")
    assert d.check("decode-0", "10.0.0.1:9300") is Unlisted.UNKNOWN_WORKER


async def test_a_job_waits_for_a_late_registration_but_not_longer_than_asked() -> None:
    d = DecodeDirectory()
    loop = asyncio.get_running_loop()
    waiting = asyncio.create_task(d.address_for("decode-0", A.address, 5.0))
    # NOTE: sleep(0) runs the waiter up to its wait on the directory: no wall time passes,
    # so nothing here depends on how busy the machine is.
    await asyncio.sleep(0)
    d.joined(Registration("decode", "decode-0", address="10.0.0.1:1"))  # not it yet (old port)
    for _ in range(3):  # the waiter wakes, re-checks, and waits again
        await asyncio.sleep(0)
    assert not waiting.done()
    d.joined(A)
    assert await asyncio.wait_for(waiting, 1) is None
    # Given up at its own deadline: not before it, and before a job that asked for longer
    # (timers fire in deadline order, whatever the load).
    longer = asyncio.create_task(d.address_for("decode-7", A.address, 10.0))
    t0 = loop.time()
    assert await d.address_for("decode-7", A.address, 0.2) is Unlisted.UNKNOWN_WORKER
    assert loop.time() - t0 >= 0.15 and not longer.done()
    longer.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await longer
