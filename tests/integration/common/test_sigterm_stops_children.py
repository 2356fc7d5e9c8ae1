"""A command that starts processes stops them when it is itself terminated: SIGTERM (what
``timeout`` sends) to `tandem bench compare` in the middle of its workload leaves no process
of its `tandem up` cluster running and every port it held free; SIGTERM to a test run leaves
no process a fixture of tests/support started."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

from services.common import children
from tests.support.ports import free_port
from tests.support.procs import needs_nats_server

ROOT = Path(__file__).resolve().parents[3]


def _config(path: Path) -> dict[str, int]:
    """A one-worker mock cluster on free ports (written to ``path``); the ports by name."""
    ports = {name: free_port() for name in ("nats", "frontend", "processor", "processor_metrics",
                                            "router", "router_metrics", "decode", "decode_metrics",
                                            "launcher_metrics")}
    path.write_text(yaml.safe_dump({
        "nats": {"url": f"nats://127.0.0.1:{ports['nats']}", "embedded": True},
        "engine": {"runner": "mock", "threads": 1, "num_kv_blocks": 256, "max_num_seqs": 8,
                   "mock": {"step_base_s": 0.01}},
        "frontend": {"host": "127.0.0.1", "port": ports["frontend"]},
        "processor": {"port": ports["processor"], "metrics_port": ports["processor_metrics"]},
        "router": {"port": ports["router"], "metrics_port": ports["router_metrics"]},
        "decode": {"replicas": 1, "port": ports["decode"], "metrics_port": ports["decode_metrics"],
                   "disagg": {"enabled": False}},
        "prefill": {"replicas": 0},
        "launcher": {"metrics_port": ports["launcher_metrics"]},
    }))
    return ports


def _children_of(pid: int) -> list[int]:
    """Every live process whose parent is ``pid`` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # NOTE: the command name in parentheses may hold spaces; the ppid follows its ")"
        if int(stat.rpartition(")")[2].split()[1]) == pid:
            found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie has ended: only its parent's wait is missing
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _bench_output(log: Path) -> str:
    return log.read_text(errors="replace")[-3000:]


def test_sigterm_to_bench_compare_stops_its_cluster(tmp_path: Path, smollm2_path: Path) -> None:
    needs_nats_server()
    ports = _config(tmp_path / "mock.yaml")
    log_dir, log = tmp_path / "bench", tmp_path / "bench.log"
    argv = [sys.executable, "-m", "services.cli", "bench", "compare",
            "--run", f"mock={tmp_path / 'mock.yaml'}", "--log-dir", str(log_dir),
            "--workload", "mixed", "--long-len", "64", "--rate", "2", "--num-requests", "100000",
            "--settle", "0", "--ready-timeout", "240"]
    with log.open("w") as out:
        bench = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                                 stdout=out, stderr=subprocess.STDOUT)
    run_dir = log_dir / "mock"
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 240
        while True:
            assert bench.poll() is None, f"the bench exited {bench.returncode}:\n{_bench_output(log)}"
            assert time.monotonic() < deadline, f"the cluster never came up:\n{_bench_output(log)}"
            try:
                up = httpx.get(f"http://127.0.0.1:{ports['frontend']}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                up = False
            if up and (run_dir / "processes.json").exists():
                break
            time.sleep(0.2)
        launchers = _children_of(bench.pid)
        parts = [p["pid"] for p in json.loads((run_dir / "processes.json").read_text())]
        pids = launchers + parts
        assert launchers and len(parts) >= 5, (launchers, parts)  # nats, router, decode, processor, frontend

        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=90) == 130, _bench_output(log)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) or not all(_port_free(p) for p in ports.values()):
            assert time.monotonic() < deadline, (
                f"still running: {[p for p in pids if _alive(p)]}, ports held: "
                f"{[n for n, p in ports.items() if not _port_free(p)]}")
            time.sleep(0.1)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            children.signal_group(pid, signal.SIGKILL)


HOLDER = """
import threading
from pathlib import Path

from tests.support.procs import NatsServer


def test_hold(tmp_path):
    server = NatsServer(tmp_path / "nats")
    server.start()
    Path({out!r}).write_text(f"{{server.proc.pid}} {{server.port}}")
    threading.Event().wait(300)  # until the SIGTERM
"""


def test_sigterm_to_a_test_run_stops_what_its_fixtures_started(tmp_path: Path) -> None:
    needs_nats_server()
    out = tmp_path / "nats.pid"
    (tmp_path / "holder").mkdir()
    test_file = tmp_path / "holder" / "test_holder.py"
    test_file.write_text(HOLDER.format(out=str(out)))
    log = tmp_path / "pytest.log"
    with log.open("w") as stdout:
        run = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly",
                                "-p", "no:cacheprovider", "--rootdir", str(test_file.parent),
                                str(test_file)],
                               cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                               stdout=stdout, stderr=subprocess.STDOUT)
    pid = port = None
    try:
        deadline = time.monotonic() + 60
        while not out.exists() or not out.read_text():
            assert run.poll() is None, f"pytest exited {run.returncode}:\n{_bench_output(log)}"
            assert time.monotonic() < deadline, f"the fixture never started:\n{_bench_output(log)}"
            time.sleep(0.05)
        pid, port = map(int, out.read_text().split())
        assert _alive(pid)
        run.send_signal(signal.SIGTERM)
        run.wait(timeout=30)
        deadline = time.monotonic() + 10
        while _alive(pid) or not _port_free(port):
            assert time.monotonic() < deadline, f"nats-server {pid} outlived the test run:\n{_bench_output(log)}"
            time.sleep(0.05)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
        if pid is not None and _alive(pid):
            os.kill(pid, signal.SIGKILL)
