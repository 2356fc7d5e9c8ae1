"""A progress bar for a simulation on a terminal, fed by the simulator's
``progress(virtual_time_s, completed_requests)`` callbacks; nothing when the stream is
not a terminal (a sweep's children, CI logs, a pipe)."""

from __future__ import annotations

import sys
from types import TracebackType
from typing import Any, TextIO


class Progress:
    """``with Progress(len(requests)) as p: simulate(..., progress=p)``: completed requests
    out of ``total``, with the virtual time reached."""

    def __init__(self, total: int, stream: TextIO | None = None) -> None:
        out = sys.stdout if stream is None else stream
        self._bar: Any = None
        if out.isatty():
            from tqdm import tqdm  # only where there is a terminal to draw on

            self._bar = tqdm(total=total, file=out, unit="req", dynamic_ncols=True,
                             desc="simulating")

    def __call__(self, virtual_time_s: float, completed: int) -> None:
        bar = self._bar
        if bar is None:
            return
        bar.set_postfix_str(f"virtual {virtual_time_s:.1f} s", refresh=False)
        # NOTE: update() redraws at most every tqdm mininterval, however often it is called.
        bar.update(completed - bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
