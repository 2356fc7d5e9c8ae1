"""What every part's process entry shares: config loading, logging, signals, task teardown."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Awaitable, Callable

from services.common.config import ClusterConfig, ConfigError, load_config

LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


def run_part(args: argparse.Namespace, serve: Callable[[ClusterConfig, int], Awaitable[None]]) -> int:
    """`tandem <part> -c FILE [--set k=v] [--replica N]`: a bad config exits 2 with the
    error naming the key; otherwise ``serve(cfg, replica)`` runs until it returns."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    asyncio.run(serve(cfg, args.replica))
    return 0


def stop_on_signals() -> asyncio.Event:
    """An event set by SIGINT or SIGTERM: the part's cue to deregister, drain and exit."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancel ``task`` and wait until it has ended; a task already done is just awaited."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
