"""Bounded waits: poll a condition until it holds, failing (not hanging) at a deadline.
Tests wait on these instead of sleeping for a guessed time."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable


async def eventually(check: Callable[[], bool | Awaitable[bool]], timeout: float = 10.0,
                     what: str = "condition") -> None:
    """Poll ``check`` (plain or async) until true; AssertionError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        ok = check()
        if inspect.isawaitable(ok):
            ok = await ok
        if ok:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)
