"""Replica slots for containers scaled by the engine: the lowest free slot, held for as
long as the part's process lives, passed on as ``--replica``."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.launcher.replica_slot import NoFreeSlot, claim, parse_args

ROOT = Path(__file__).resolve().parents[3]


def test_claims_the_lowest_free_slot_and_frees_it_when_closed(tmp_path: Path) -> None:
    a, fa = claim(tmp_path)
    b, fb = claim(tmp_path)
    assert (a, b) == (0, 1)
    os.close(fa)
    c, fc = claim(tmp_path)
    assert c == 0  # the dead replica's slot is taken again
    os.close(fb)
    os.close(fc)


def test_all_slots_held_is_an_error_naming_the_directory(tmp_path: Path) -> None:
    fds = [claim(tmp_path, max_slots=2)[1] for _ in range(2)]
    with pytest.raises(NoFreeSlot, match=str(tmp_path)):
        claim(tmp_path, max_slots=2)
    for fd in fds:
        os.close(fd)


def test_parses_the_command_after_the_separator() -> None:
    args = parse_args(["--advertise-ip", "decode.advertise_host", "/slots/decode", "--",
                       "tandem", "decode", "-c", "x.yaml"])
    assert args.directory == Path("/slots/decode") and args.advertise_ip == "decode.advertise_host"
    assert args.command == ("tandem", "decode", "-c", "x.yaml")


def _run(tmp_path: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    # the "part": prints its argv, then waits for stdin to close (holding the slot)
    script = "import sys; print(sys.argv[1:], flush=True); sys.stdin.read()"
    return subprocess.Popen(
        [sys.executable, "-m", "services.launcher.replica_slot", *extra, str(tmp_path), "--",
         sys.executable, "-c", script],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def test_the_part_holds_its_slot_for_its_lifetime(tmp_path: Path) -> None:
    first = _run(tmp_path)
    assert first.stdout.readline().strip() == "['--replica', '0']"
    second = _run(tmp_path, "--advertise-ip", "decode.advertise_host",
                  env={"TANDEM_PART_ARGS": "--set engine.device=cuda"})
    line = second.stdout.readline().strip()
    assert line.startswith("['--replica', '1', '--set', 'decode.advertise_host=")
    assert line.endswith("'--set', 'engine.device=cuda']")
    first.communicate("")  # the first part ends: its slot is free again
    third = _run(tmp_path)
    assert third.stdout.readline().strip() == "['--replica', '0']"
    second.communicate("")
    third.communicate("")
