"""Where a hung async test waits: every asyncio task's stack, printed shortly before
pytest-timeout ends the test.

pytest-timeout prints each thread's stack, but an async test that hangs sits in the event
loop's ``select`` with the interesting part (which ``await`` never returns) in a task. The
dump goes to stderr, which pytest shows with the failure.
"""

from __future__ import annotations

import asyncio
import gc
import sys
import threading


def dump_running_loops() -> None:
    """Ask each running event loop (found among live objects: the test's loop belongs to
    pytest-asyncio) to print its tasks; a loop that is blocked never prints, and the thread
    stacks that pytest-timeout prints next show what blocks it."""
    # NOTE: type(), not isinstance(): that reads __class__, which some module proxies
    # answer with a deprecation warning
    loops = [o for o in gc.get_objects() if issubclass(type(o), asyncio.AbstractEventLoop)]
    for loop in loops:
        if loop.is_running() and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(_print_tasks, loop)
            except RuntimeError:  # closed meanwhile
                pass


def _print_tasks(loop: asyncio.AbstractEventLoop) -> None:
    tasks = asyncio.all_tasks(loop)
    print(f"~~~~~ {len(tasks)} asyncio tasks shortly before the timeout ~~~~~", file=sys.stderr)
    for task in tasks:
        print(f"--- task {task.get_name()}", file=sys.stderr)
        for line in _await_chain(task.get_coro()):
            print(line, file=sys.stderr)
    sys.stderr.flush()


def _await_chain(coro: object) -> list[str]:
    """The line each frame of a suspended coroutine waits on, outermost first, followed down
    what it awaits (``Task.print_stack`` shows only the outermost frame)."""
    lines = []
    first = coro
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None) or getattr(
            coro, "gi_frame", None)
        if frame is not None:
            code = frame.f_code
            lines.append(f"  {code.co_filename}:{frame.f_lineno} in {code.co_name}")
        nxt = (getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None)
               or getattr(coro, "gi_yieldfrom", None))
        if nxt is None and frame is None:
            # an async generator's asend/athrow awaitable exposes no attribute for its
            # generator: find it among what the awaitable refers to
            nxt = next((r for r in gc.get_referents(coro) if hasattr(r, "ag_frame")), None)
        coro = nxt
    if not lines:
        lines.append(f"  {first!r}")
    return lines


def start_timer(after_s: float) -> threading.Timer:
    timer = threading.Timer(after_s, dump_running_loops)
    timer.daemon = True
    timer.start()
    return timer
