"""Stop strings with hold-back: no part of a stop string is ever emitted.

Text arrives in pieces. A suffix of the unemitted text that is a proper prefix of some stop
string may turn into a stop string with the next piece, so it is held back until it either
completes one (the output ends before it) or cannot any more (it is emitted).

Which stop wins: the occurrence that *completes* first in the text (smallest end), ties
going to the one that starts first. This does not depend on how the text was split into
pieces, so streaming and non-streaming answers are the same.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """One per request. ``feed`` text pieces, then ``flush`` if no stop string matched."""

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self._stops = tuple(dict.fromkeys(stops))
        self._max_hold = max((len(s) for s in self._stops), default=1) - 1
        self._pending = ""  # text received but not yet emitted
        self.stopped = False
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        """Add ``text``; return what may be emitted now. After a match ``stopped`` is True,
        the returned text ends right before the stop string and later feeds return ""."""
        if self.stopped:
            return ""
        if not self._stops:
            return text
        buf = self._pending + text
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for s in self._stops:
            i = buf.find(s)
            if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
                best = (i + len(s), i, s)
        if best is not None:
            self.stopped, self.matched, self._pending = True, best[2], ""
            return buf[: best[1]]
        hold = self._hold_length(buf)
        self._pending = buf[len(buf) - hold:] if hold else ""
        return buf[: len(buf) - hold]

    def flush(self) -> str:
        """The held-back text, at the end of a stream that did not stop on a string."""
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out

    def _hold_length(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop string."""
        for n in range(min(self._max_hold, len(buf)), 0, -1):
            tail = buf[-n:]
            if any(s.startswith(tail) for s in self._stops):
                return n
        return 0
