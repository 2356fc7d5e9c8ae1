"""One request's grammar matcher: advanced by each token the request accepts."""

from __future__ import annotations

import llguidance as llg


class GrammarState:
    __slots__ = ("matcher", "kind", "error", "last_pos")

    def __init__(self, matcher: llg.LLMatcher, kind: str) -> None:
        self.matcher = matcher
        self.kind = kind
        self.error: str | None = None  # set once the matcher refused a token or failed
        # The sequence position of the last token ``advance_at`` consumed: the overlapped
        # loop advances a batch's matchers ahead of the rest of its update.
        self.last_pos = -1

    def advance(self, token: int) -> str | None:
        """Accept ``token``; None, or why the grammar refuses it (the state is then dead)."""
        if self.error is not None:
            return self.error
        m = self.matcher
        if not m.consume_token(token) or m.is_error():
            detail = m.get_error() if m.is_error() else ""
            self.error = (f"the {self.kind} grammar refused token {token}"
                          + (f": {detail.strip()}" if detail else ""))
        return self.error

    def advance_at(self, pos: int, token: int) -> str | None:
        """``advance`` by the token at sequence position ``pos``, once: a position already
        consumed only returns the state's error."""
        if pos <= self.last_pos:
            return self.error
        self.last_pos = pos
        return self.advance(token)

    @property
    def dead(self) -> bool:
        """Refused a token or failed: its mask is meaningless (any row will do)."""
        return self.error is not None or self.matcher.is_error()
