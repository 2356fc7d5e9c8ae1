"""Every environment variable tandem reads, in one place."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where fetched models and other downloads live (``TANDEM_CACHE_DIR``)."""
    return Path(os.environ.get("TANDEM_CACHE_DIR", Path.home() / ".cache" / "tandem"))


def in_ci() -> bool:
    """True under CI (``CI=true``): tests that need the real model fail instead of skip."""
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")
