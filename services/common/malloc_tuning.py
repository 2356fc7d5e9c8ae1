"""glibc malloc thresholds for processes that move large payloads (KV, image embeddings).

gRPC hands every received message to Python in a fresh buffer of about the chunk size
(1 MiB), and the sender builds one per chunk too. With glibc's defaults the arena that
freed such a buffer trims its top back to the kernel almost at once (the trim threshold
follows the largest freed mmapped chunk, ~2 MiB), so the next buffer faults in and zeroes
fresh pages: on the bench machine page faults, page clearing and `madvise` took about
half of the receiving process's CPU, and KV over gRPC ran at ~1.3 GB/s instead of ~2.
Fixing both thresholds keeps buffers below ``MMAP_THRESHOLD`` in the heap and lets an
arena hold up to ``TRIM_THRESHOLD`` of free top before returning it.

Setting only one of them is worse than neither: glibc then stops adapting the other.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

log = logging.getLogger(__name__)

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

# NOTE: 32 MiB is where glibc's adaptive threshold itself stops on 64-bit: larger blocks
# (KV caches, weights, big activations) stay mmapped as before.
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 128 << 20

# Variables a user sets to tune malloc their own way; their choice wins.
USER_SETTINGS = ("GLIBC_TUNABLES", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def tune_malloc() -> bool:
    """Apply the thresholds; True if they were set. Does nothing (False) off glibc, when
    ``TANDEM_MALLOC=system``, or when the environment already tunes malloc."""
    if os.environ.get("TANDEM_MALLOC", "tuned") == "system":
        return False
    if any(os.environ.get(k) for k in USER_SETTINGS):
        return False
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    if mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1 or mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) != 1:
        log.warning("mallopt refused the transfer thresholds; glibc defaults stay")
        return False
    return True
