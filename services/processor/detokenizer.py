"""Incremental detokenization that is right for multi-byte UTF-8 and BPE merges.

Decoding one token at a time is wrong twice over: a character's UTF-8 bytes may be split
across tokens (each half decodes to U+FFFD), and some decoders change a token's text
depending on its neighbours (SentencePiece strips the leading space of the first token).
So we decode a short sliding window of ids: ``[prefix_offset, read_offset)`` is text
already emitted, ``[prefix_offset, len)`` the same plus the new tokens; the new text is
the difference, emitted only once it no longer ends in U+FFFD (an incomplete character).

Contract: the concatenation of every ``add`` result and the final ``flush`` equals
``tokenizer.decode(all ids)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

_REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text pieces; one per request."""

    def __init__(self, tokenizer: Decoder, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # window start: already-emitted tokens kept for context
        self._read_offset = 0  # tokens before this are emitted

    @property
    def num_tokens(self) -> int:
        return len(self._ids)

    def add(self, token_ids: Sequence[int]) -> str:
        """Append ``token_ids``; return the text that is now final ("" if none yet)."""
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        ids = self._ids
        prefix = self._tok.decode(ids[self._prefix_offset:self._read_offset], self._skip)
        full = self._tok.decode(ids[self._prefix_offset:], self._skip)
        # NOTE: only advance when the window's text grew and ends on a whole character; a
        # trailing U+FFFD means the next token may complete the bytes.
        if len(full) <= len(prefix) or full.endswith(_REPLACEMENT):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(ids)
        return full[len(prefix):]

    def flush(self) -> str:
        """The text still held back at the end of the stream (it may end in U+FFFD: the
        model stopped inside a character, and ``decode(all ids)`` says the same)."""
        ids = self._ids
        prefix = self._tok.decode(ids[self._prefix_offset:self._read_offset], self._skip)
        full = self._tok.decode(ids[self._prefix_offset:], self._skip)
        self._prefix_offset = self._read_offset = len(ids)
        return full[len(prefix):]
