"""What every bench result file carries: the command line and the machine."""

from __future__ import annotations

import json
from pathlib import Path

from services.bench import results
from services.cli import build_parser


def test_header_names_the_command_as_typed_and_the_machine() -> None:
    argv = ["bench", "router", "--blocks", "2000", "--json", "/tmp/a b.json"]
    args = build_parser().parse_args(argv)
    args._argv = argv  # as services.cli.main sets it
    head = results.header(args)
    assert head["command"] == "tandem bench router --blocks 2000 --json '/tmp/a b.json'"
    m = head["machine"]
    assert isinstance(m, dict) and m["cores"] and m["cpu_model"] and m["python"]
    assert set(m) >= {"cpu_model", "cores", "cores_usable", "torch", "load_average"}


def test_finish_and_write_json(tmp_path: Path) -> None:
    out = results.finish({"command": "tandem bench x", "machine": {}}, {"figure": 1.0})
    assert list(out)[:3] == ["command", "machine", "load_average_after"] and out["figure"] == 1.0
    path = tmp_path / "deep" / "r.json"
    results.write_json(path, out)
    assert json.loads(path.read_text()) == out
    results.write_json(None, out)  # no file asked for: nothing written, no error
