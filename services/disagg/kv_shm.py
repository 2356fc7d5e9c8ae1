"""Same-host KV transfer through a file in /dev/shm. The gRPC bytes path always works; this one
is an optimisation between processes that share a /dev/shm (docs/architecture.md, "gRPC services").

The prefill worker writes the KV bytes into a fresh segment and sends only its name in the
KvTransfer header; the decode worker reads it into its buffer and unlinks it. The sender
unlinks it too once the call ended, whatever the outcome, so a segment outlives a transfer
only if the prefill process dies between writing it and the call returning.

Who is "the same host": ``host_id()`` names the kernel boot and the /dev/shm mount, so two
containers with private /dev/shm mounts on one machine get different ids (and use gRPC).
"""

from __future__ import annotations

import functools
import mmap
import os
import re
import uuid

SHM_DIR = "/dev/shm"
# KvTransferAck.error prefix: the segment could not be used there; resend as gRPC bytes.
SHM_UNAVAILABLE = "shm unavailable"
# "kv": KV transfers; "mm": image embeddings (services/disagg/shm_pool.py for both).
_NAME = re.compile(r"tandem-(kv|mm)-[0-9a-f]{32}")
KV_PREFIX, MM_PREFIX = "tandem-kv-", "tandem-mm-"


class ShmUnavailableError(OSError):
    """The segment cannot be created, opened or read here (not the same /dev/shm, full, gone)."""


@functools.cache
def host_id() -> str:
    """An id equal in two processes iff they see the same /dev/shm (boot id + mount); "" if
    there is no usable /dev/shm."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        st = os.stat(SHM_DIR)
    except OSError:
        return ""
    return f"{boot}/{st.st_dev}:{st.st_ino}"


def new_segment_name(kind: str = "kv") -> str:
    return f"tandem-{kind}-{uuid.uuid4().hex}"


def segment_path(name: str) -> str:
    """The file of a segment name; ValueError for anything but names ``new_segment_name``
    makes (the receiver unlinks what it is sent: no other path may get through)."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"invalid shared-memory segment name {name!r}")
    return os.path.join(SHM_DIR, name)


def write_segment(name: str, data: memoryview) -> None:
    """Create the segment (it must not exist) holding ``data``; ShmUnavailableError (and
    nothing left behind) on failure."""
    path = segment_path(name)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        raise ShmUnavailableError(f"cannot create {path}: {e}") from e
    try:
        with os.fdopen(fd, "wb", buffering=0) as f:
            view = data.cast("B")
            done = 0
            while done < len(view):
                done += f.write(view[done:])
    except OSError as e:
        unlink_segment(name)
        raise ShmUnavailableError(f"cannot write {path}: {e}") from e


def map_segment(name: str, nbytes: int) -> mmap.mmap:
    """Map the segment (which must hold exactly ``nbytes``) into memory, its pages faulted in
    up front; the mapping outlives the unlink of the file. ShmUnavailableError if it cannot
    be opened or mapped; ValueError on a size mismatch."""
    path = segment_path(name)
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError as e:
        raise ShmUnavailableError(f"cannot open {path}: {e}") from e
    try:
        size = os.fstat(fd).st_size
        if size != nbytes:
            raise ValueError(f"shared-memory segment {name} holds {size} bytes; expected {nbytes}")
        if nbytes == 0:
            raise ValueError(f"shared-memory segment {name} is empty")
        try:
            # NOTE: shared (not private) so that MAP_POPULATE maps the existing tmpfs pages
            # instead of copying each one.
            return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                             prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            raise ShmUnavailableError(f"cannot map {path}: {e}") from e
    finally:
        os.close(fd)


def unlink_segment(name: str) -> None:
    """Remove the segment if it is still there (both ends call this; the second is a no-op)."""
    try:
        os.unlink(segment_path(name))
    except FileNotFoundError:
        pass
