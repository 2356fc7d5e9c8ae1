"""One parse of a GGUF file per process, shared by the weights loader and the tokenizer.

GGUFReader builds a view per metadata element at open, which for a 49k-token vocabulary
takes seconds; both loaders read the same file at startup, so they share the reader.
"""

from __future__ import annotations

import functools
from pathlib import Path

from gguf import GGUFReader


@functools.lru_cache(maxsize=2)
def _open(path: Path, mtime_ns: int) -> GGUFReader:
    return GGUFReader(path)


def open_gguf(path: str | Path) -> GGUFReader:
    """A (cached) reader for ``path``; a file rewritten in place is read anew."""
    p = Path(path).resolve()
    return _open(p, p.stat().st_mtime_ns)
