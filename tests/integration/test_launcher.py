"""The launcher's supervisor for real: nats-server and `tandem router` as child processes,
readiness, clean stop on SIGTERM (no orphans), a dying child, a busy port, a stuck child."""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.common.config import parse_config
from services.launcher.nats import find_nats_server
from services.launcher.plan import PortUse, ProcessSpec, Readiness, plan
from services.launcher.supervisor import Supervisor, is_ready
from tests.support.ports import free_port
from tests.support.procs import needs_nats_server

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _needs_nats_server() -> None:
    needs_nats_server()



def _ports_overrides() -> list[str]:
    return [f"nats.url=nats://127.0.0.1:{free_port()}", f"router.port={free_port()}",
            f"router.metrics_port={free_port()}"]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _up(run_dir: Path, overrides: list[str]) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "services.cli", "up", "--only", "nats,router",
            "--run-dir", str(run_dir), "--ready-timeout", "60"]
    for o in overrides:
        argv += ["--set", o]
    return subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _read_until(proc: subprocess.Popen[str], marker: str, limit: int = 200) -> list[str]:
    lines: list[str] = []
    assert proc.stdout is not None
    for _ in range(limit):
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line.rstrip("\n"))
        if marker in line:
            return lines
    raise AssertionError(f"{marker!r} never printed; output:\n" + "\n".join(lines))


def test_up_starts_nats_and_router_and_sigterm_stops_them(tmp_path: Path) -> None:
    overrides = _ports_overrides()
    router_port = int(overrides[1].split("=")[1])
    proc = _up(tmp_path, overrides)
    try:
        lines = _read_until(proc, "started in")
        assert any(line.startswith("ready    nats") for line in lines)
        assert any(line.startswith("ready    router") for line in lines)
        pids = {p["name"]: p["pid"] for p in json.loads((tmp_path / "processes.json").read_text())}
        assert set(pids) == {"nats", "router"}
        assert not any(_gone(pid) for pid in pids.values())
        socket.create_connection(("127.0.0.1", router_port), timeout=1).close()
        assert (tmp_path / "nats" / "jetstream").is_dir()  # NATS's store is the run's own

        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out
    assert "stopped  router (exited with code 0)" in out
    assert out.index("stopped  router") < out.index("stopped  nats")  # reverse start order
    assert all(_gone(pid) for pid in pids.values())
    assert "router replica 0 serving gRPC" in (tmp_path / "logs" / "router.log").read_text()


def test_a_busy_port_is_refused_before_anything_starts(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        overrides = [*_ports_overrides()[:2], f"router.metrics_port={port}"]
        proc = _up(tmp_path, overrides)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2, out
    assert f"port {port} (router metrics, set by router.metrics_port)" in out
    assert not (tmp_path / "processes.json").exists()


def _real_specs(tmp_path: Path) -> list[ProcessSpec]:
    """nats-server and `tandem router` as `tandem up` plans them, on free ports."""
    overrides = _ports_overrides()
    specs = plan(parse_config({}, overrides), None, overrides, nats_data_dir=tmp_path / "nats",
                 nats_binary=find_nats_server())
    return [s for s in specs if s.part in ("nats", "router")]


def _python_spec(name: str, code: str) -> ProcessSpec:
    port = free_port()
    return ProcessSpec(name=name, part="processor", argv=(sys.executable, "-c", code),
                       ports=(PortUse("grpc", port, "processor.port"),),
                       ready=Readiness("tcp", "127.0.0.1", port))


def test_a_child_that_dies_is_named_and_the_rest_are_stopped(tmp_path: Path) -> None:
    doomed = _python_spec("doomed", "import sys; print('cannot load the model'); sys.exit(3)")
    out = io.StringIO()
    sup = Supervisor([*_real_specs(tmp_path), doomed], tmp_path, out=out, ready_timeout=60, echo=True)
    assert sup.run(install_signals=False) == 1
    text = out.getvalue()
    assert "error: doomed exited with code 3; stopping the cluster" in text
    assert "  cannot load the model" in text  # the report's tail
    assert "doomed | cannot load the model" in text  # echoed live, prefixed with the name
    assert (tmp_path / "logs" / "doomed.log").read_text() == "cannot load the model\n"
    pids = [p["pid"] for p in json.loads((tmp_path / "processes.json").read_text())]
    assert len(pids) == 3 and all(_gone(pid) for pid in pids)
    assert "stopped  nats" in text and "stopped  router" in text


def test_a_child_that_ignores_sigterm_is_killed(tmp_path: Path) -> None:
    port = free_port()
    stubborn = ProcessSpec(
        name="stubborn", part="processor",
        argv=(sys.executable, "-c",
              "import signal, socket, time\n"
              "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
              f"s = socket.socket(); s.bind(('127.0.0.1', {port})); s.listen()\n"
              "time.sleep(600)\n"),
        ports=(PortUse("grpc", port, "processor.port"),),
        ready=Readiness("tcp", "127.0.0.1", port),
    )
    out = io.StringIO()
    sup = Supervisor([stubborn], tmp_path, out=out, stop_timeout=0.5)

    def banner(_elapsed: float) -> str:
        sup.stop_event.set()  # the banner means everything is ready: ask for a stop right then
        return "READY"

    sup.banner = banner
    assert sup.run(install_signals=False) == 0
    text = out.getvalue()
    assert "READY" in text
    assert "stubborn did not stop in 0.5 s: killing it" in text
    assert "stopped  stubborn (was killed by SIGKILL)" in text


def test_readiness_timeout_names_the_part_and_stops_it(tmp_path: Path) -> None:
    never = _python_spec("never-ready", "import time; time.sleep(600)")
    out = io.StringIO()
    sup = Supervisor([never], tmp_path, out=out, ready_timeout=0.3, poll_s=0.05)
    assert sup.run(install_signals=False) == 1
    text = out.getvalue()
    assert "error: not ready after 0.3 s: never-ready" in text
    pid = json.loads((tmp_path / "processes.json").read_text())[0]["pid"]
    assert _gone(pid)
    assert "stopped  never-ready (was killed by SIGTERM)" in text


def test_http_readiness_needs_a_200_not_just_a_listening_port(tmp_path: Path) -> None:
    port = free_port()
    ready = Readiness("http", "127.0.0.1", port, "/health")
    server = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while not is_ready(Readiness("tcp", "127.0.0.1", port)):
            assert server.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        assert not is_ready(ready)  # listening, but /health is 404
        (tmp_path / "health").write_text("ok")
        assert is_ready(ready)
    finally:
        server.terminate()
        server.wait()
