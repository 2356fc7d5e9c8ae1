"""A replica index for a part scaled by the container engine (``docker compose --scale
decode=N``), where nothing tells a container which replica it is.

``python -m services.launcher.replica_slot DIR -- tandem decode -c ...`` takes an exclusive
``flock`` on the lowest free ``DIR/slot-<i>`` and execs the command with ``--replica <i>``
added, the lock's file descriptor inherited: the slot is held for exactly as long as the
part's process lives (the kernel drops the lock when it dies, however it dies), so a
restarted container takes a free slot again. ``DIR`` is a volume every replica of the
role mounts. Replica i then has the instance id ``<role>-i`` and the ports ``base + i``
(the CLI's convention), so replicas never collide, also on one host network.

``--advertise-ip KEY`` adds ``--set KEY=<the container's own address>``: on a bridge
network every replica of a service shares the service's name, so discovery must publish
each one's own address (with host networking the config's 127.0.0.1 is right).
``TANDEM_PART_ARGS`` (shell words) go last: an override file's additions, such as
compose.gpu.yaml's ``--set engine.device=cuda``, without repeating the command.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import shlex
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from services.common import env

MAX_SLOTS = 64


class NoFreeSlot(RuntimeError):
    """Every slot under the directory is held by a live replica."""


def claim(directory: Path, max_slots: int = MAX_SLOTS) -> tuple[int, int]:
    """(index, fd) of the lowest slot not held by another process; the lock lives as long
    as ``fd`` stays open in some process (it is inheritable: it survives exec)."""
    for i in range(max_slots):
        fd = os.open(directory / f"slot-{i}", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        os.set_inheritable(fd, True)
        return i, fd
    raise NoFreeSlot(f"all {max_slots} slots under {directory} are held")


@dataclass(frozen=True)
class SlotArgs:
    directory: Path
    advertise_ip: str | None  # the config key to set to this host's address
    command: tuple[str, ...]


def parse_args(argv: Sequence[str] | None = None) -> SlotArgs:
    parser = argparse.ArgumentParser(prog="python -m services.launcher.replica_slot",
                                     usage="%(prog)s [--advertise-ip KEY] DIR -- COMMAND ...")
    parser.add_argument("directory", type=Path)
    parser.add_argument("--advertise-ip", metavar="KEY", default=None,
                        help="config key to set to this host's address (decode.advertise_host)")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command after DIR")
    return SlotArgs(args.directory, args.advertise_ip, tuple(command))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    index, _fd = claim(args.directory)
    print(f"replica_slot: {args.directory} slot {index}", file=sys.stderr, flush=True)
    extra = ["--replica", str(index)]
    if args.advertise_ip:
        extra += ["--set", f"{args.advertise_ip}={socket.gethostbyname(socket.gethostname())}"]
    extra += shlex.split(os.environ.get(env.PART_ARGS, ""))
    os.execvp(args.command[0], [*args.command, *extra])


if __name__ == "__main__":
    sys.exit(main())
