"""The launcher's supervisor for real: nats-server and `tandem router` as child processes,
readiness, clean stop on SIGTERM (no orphans), a busy port, a stuck child; a killed child
restarted while the rest keeps running, a child failing at start given up on, a restart that
never gets ready, and a dying child stopping everything with fail_fast."""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from services.common.config import parse_config
from services.launcher.metrics import LauncherMetrics
from services.launcher.nats import find_nats_server
from services.launcher.plan import PortUse, ProcessSpec, Readiness, plan
from services.launcher.restart import RestartPolicy
from services.launcher.supervisor import Supervisor, is_ready
from tests.support.ports import free_port
from tests.support.procs import needs_nats_server

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True)
def _needs_nats_server() -> None:
    needs_nats_server()



def _ports_overrides() -> list[str]:
    return [f"nats.url=nats://127.0.0.1:{free_port()}", f"router.port={free_port()}",
            f"router.metrics_port={free_port()}", f"launcher.metrics_port={free_port()}"]


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
        overrides = [*_ports_overrides()[:2], f"router.metrics_port={port}",
                     f"launcher.metrics_port={free_port()}"]
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


def test_fail_fast_a_child_that_dies_is_named_and_the_rest_are_stopped(tmp_path: Path) -> None:
    doomed = _python_spec("doomed", "import sys; print('cannot load the model'); sys.exit(3)")
    out = io.StringIO()
    sup = Supervisor([*_real_specs(tmp_path), doomed], tmp_path, out=out, ready_timeout=60, echo=True,
                     fail_fast=True)
    assert sup.run(install_signals=False) == 1
    text = out.getvalue()
    assert "error: doomed exited with code 3; stopping the cluster" in text
    assert "  cannot load the model" in text  # the report's tail
    assert "doomed | cannot load the model" in text  # echoed live, prefixed with the name
    assert (tmp_path / "logs" / "doomed.log").read_text() == "cannot load the model\n"
    pids = [p["pid"] for p in json.loads((tmp_path / "processes.json").read_text())]
    assert len(pids) == 3 and all(_gone(pid) for pid in pids)
    assert "stopped  nats" in text and "stopped  router" in text


def _run_in_thread(sup: Supervisor) -> tuple[threading.Thread, list[int]]:
    status: list[int] = []
    thread = threading.Thread(target=lambda: status.append(sup.run(install_signals=False)), daemon=True)
    thread.start()
    return thread, status


def _wait_text(out: io.StringIO, marker: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while marker not in out.getvalue():
        assert time.monotonic() < deadline, f"{marker!r} never printed:\n{out.getvalue()}"
        time.sleep(0.05)


def _pids(run_dir: Path) -> dict[str, int]:
    return {p["name"]: p["pid"] for p in json.loads((run_dir / "processes.json").read_text())}


def _sample(metrics: LauncherMetrics, name: str, part: str) -> float | None:
    return metrics.registry.get_sample_value(name, {"part": part})


def test_a_child_killed_is_restarted_and_the_rest_keep_running(tmp_path: Path) -> None:
    specs = _real_specs(tmp_path)
    metrics = LauncherMetrics([s.name for s in specs])
    out = io.StringIO()
    sup = Supervisor(specs, tmp_path, out=out, ready_timeout=60, metrics=metrics,
                     policy=RestartPolicy(backoff_s=0.2))
    sup.banner = lambda _elapsed: "BANNER"
    thread, status = _run_in_thread(sup)
    try:
        _wait_text(out, "BANNER")
        before = _pids(tmp_path)
        assert _sample(metrics, "tandem_launcher_part_up", "router") == 1
        os.kill(before["router"], signal.SIGKILL)
        _wait_text(out, "after restart 1 (127.0.0.1:")
        after = _pids(tmp_path)
        assert after["nats"] == before["nats"] and not _gone(after["nats"])  # the rest stayed
        assert after["router"] != before["router"] and not _gone(after["router"])
        router_port = specs[1].ready.port
        socket.create_connection(("127.0.0.1", router_port), timeout=1).close()
        assert _sample(metrics, "tandem_launcher_restarts_total", "router") == 1
        assert _sample(metrics, "tandem_launcher_restarts_total", "nats") == 0
        assert _sample(metrics, "tandem_launcher_part_up", "router") == 1
    finally:
        sup.stop_event.set()
        thread.join(timeout=60)
    assert status == [0], out.getvalue()
    text = out.getvalue()
    assert "restart  router was killed by SIGKILL after " in text
    assert "; restart 1 in 0.2 s" in text
    assert "stopping the cluster" not in text
    log = (tmp_path / "logs" / "router.log").read_text()
    assert "----- tandem up: restart 1 of router -----" in log
    assert log.count("serving gRPC") == 2  # one log across both runs
    assert all(_gone(pid) for pid in _pids(tmp_path).values())


def test_a_child_that_keeps_failing_at_start_gives_up_naming_it(tmp_path: Path) -> None:
    doomed = _python_spec("doomed", "import sys; print('model.path: /typo.gguf not found'); sys.exit(1)")
    out = io.StringIO()
    sup = Supervisor([*_real_specs(tmp_path), doomed], tmp_path, out=out, ready_timeout=60,
                     policy=RestartPolicy(backoff_s=0.05, max_quick_restarts=2))
    assert sup.run(install_signals=False) == 1
    text = out.getvalue()
    assert "restart  doomed exited with code 1 after" in text
    assert "restart 1 in 0.05 s" in text and "restart 2 in 0.1 s" in text
    assert "error: doomed exited with code 1: 3 quick failures in a row (none stayed up 60 s)" in text
    assert "more than launcher.max_quick_restarts=2; giving up" in text
    assert "  model.path: /typo.gguf not found" in text  # its last lines, for the fix
    assert "stopped  nats" in text and "stopped  router" in text
    assert all(_gone(pid) for pid in _pids(tmp_path).values())


def test_a_restart_that_never_gets_ready_is_killed_and_counts_as_a_failure(tmp_path: Path) -> None:
    port = free_port()
    marker = tmp_path / "started-once"
    code = ("import pathlib, socket, time\n"
            f"m = pathlib.Path({str(marker)!r})\n"
            "if m.exists():\n    time.sleep(600)\n"  # every restart hangs before listening
            f"m.touch(); s = socket.socket(); s.bind(('127.0.0.1', {port})); s.listen(); time.sleep(600)\n")
    spec = ProcessSpec(name="hangs", part="processor", argv=(sys.executable, "-c", code),
                       ports=(PortUse("grpc", port, "processor.port"),),
                       ready=Readiness("tcp", "127.0.0.1", port))
    out = io.StringIO()
    sup = Supervisor([spec], tmp_path, out=out, ready_timeout=2, poll_s=0.05,
                     policy=RestartPolicy(backoff_s=0.05, max_quick_restarts=1))
    sup.banner = lambda _elapsed: "BANNER"
    thread, status = _run_in_thread(sup)
    _wait_text(out, "BANNER")
    os.kill(_pids(tmp_path)["hangs"], signal.SIGKILL)
    thread.join(timeout=60)
    text = out.getvalue()
    assert status == [1], text
    assert "error: hangs not ready 2 s after restart 1: killing it" in text
    assert "error: hangs was killed by SIGKILL: 2 quick failures in a row" in text


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
