"""What every part's process entry shares: config loading, logging, signals, task teardown."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Collection

from services.common.config import ClusterConfig, ConfigError, load_config

LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"

log = logging.getLogger(__name__)

# How long cancel_and_wait waits before it cancels a task again (see there).
_RECANCEL_S = 0.5


class PartFailed(RuntimeError):
    """A failure that ends the part and whose message says all an operator needs (a TP
    rank died): the part logs that one line and exits 1, without a traceback burying it."""


def run_part(args: argparse.Namespace, serve: Callable[[ClusterConfig, int], Awaitable[None]]) -> int:
    """`tandem <part> -c FILE [--set k=v] [--replica N]`: a bad config exits 2 with the
    error naming the key; otherwise ``serve(cfg, replica)`` runs until it returns."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    failure: str | None = None
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        try:
            runner.run(serve(cfg, args.replica))
        except PartFailed as e:
            failure = str(e)
        # NOTE: the failure's frames hold the gRPC server; freed after the loop closes, its
        # finalizer schedules onto a closed loop and prints a traceback of its own
        gc.collect()
    if failure is not None:
        log.error("%s", failure)
        return 1
    return 0


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop where it is installed (a shorter path per socket event for every
    hop: HTTP, gRPC callbacks, NATS), else asyncio's own (None). TANDEM_EVENT_LOOP=asyncio
    forces the standard loop."""
    if os.environ.get("TANDEM_EVENT_LOOP", "uvloop") == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def stop_on_signals(stop: asyncio.Event | None = None) -> asyncio.Event:
    """An event (``stop``, or a new one) set by SIGINT or SIGTERM: the part's cue to
    deregister, drain and exit.

    Call it before the part opens its first port: `tandem up` (and any orchestrator) calls
    a part ready once a port accepts and may signal it right then; a signal that arrives
    while the part is still starting is kept, and acted on once startup is done, instead
    of killing the process by the default action mid-start."""
    stop = asyncio.Event() if stop is None else stop
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancel ``task`` and wait until it has ended; a task already done is just awaited (its
    error, if it failed, is raised here).

    The cancel is repeated until the task ends: a task can lose one. Python 3.11's
    ``asyncio.wait_for`` returns a result that arrives in the same loop iteration as the
    cancel and drops the cancel (gh-86296, fixed in 3.12); nats-py requests sit inside
    ``wait_for``, so a discovery heartbeat cancelled as its put was answered beat on, and
    the lease's close waited for it forever.
    """
    if task is None:
        return
    while not task.done():
        task.cancel()
        # NOTE: asyncio.wait, not ``await task``: a cancel of the caller must not be
        # forwarded into the task (it may drop that one too) and the wait must end
        await asyncio.wait({task}, timeout=_RECANCEL_S)
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def cancel_all_and_wait(tasks: Collection[asyncio.Task]) -> None:
    """``cancel_and_wait`` for several tasks at once; their errors are not raised (each
    task reports its own)."""
    left = set(tasks)
    while left:
        for t in left:
            t.cancel()
        _, left = await asyncio.wait(left, timeout=_RECANCEL_S)

