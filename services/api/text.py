"""Text that can cross every hop: JSON's "\\ud800" escape decodes to a lone UTF-16 surrogate,
which no UTF-8 writer, tokenizer or protobuf string accepts."""

from __future__ import annotations


def lone_surrogate(s: str) -> int | None:
    """The index of the first lone surrogate in ``s``, or None when ``s`` is valid Unicode."""
    if s.isascii():
        return None
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None
