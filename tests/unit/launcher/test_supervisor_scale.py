"""The supervisor starts and drains replicas while it runs (the planner's local actuator),
with real child processes: a small Python server per replica that listens on its slot's
port and exits 0 on SIGTERM; and the launcher's control endpoint in front of it."""

from __future__ import annotations

import io
import json
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.launcher.control import serve_control
from services.launcher.plan import PortUse, ProcessSpec, Readiness
from services.launcher.supervisor import Supervisor
from tests.support.ports import free_port

CHILD = """
import signal, socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1]))); s.listen()
signal.signal(signal.SIGTERM, lambda *_: (print("draining", flush=True), sys.exit(0)))
print("serving", flush=True)
while True:
    s.accept()[0].close()
"""


def _spec(part: str, i: int, port: int) -> ProcessSpec:
    return ProcessSpec(name=f"{part}-{i}", part=part, argv=(sys.executable, "-c", CHILD, str(port + i)),
                       ports=(PortUse("grpc", port + i, f"{part}.port"),),
                       ready=Readiness("tcp", "127.0.0.1", port + i))


class Running:
    def __init__(self, sup: Supervisor, out: io.StringIO) -> None:
        self.sup, self.out = sup, out

    def wait_for(self, line: str, timeout: float = 20.0, after: int = 0) -> None:
        """Until ``line`` is said (past the first ``after`` characters of the output)."""
        deadline = time.monotonic() + timeout
        while line not in self.out.getvalue()[after:]:
            assert time.monotonic() < deadline, f"{line!r} not said:\n{self.out.getvalue()}"
            time.sleep(0.05)


@pytest.fixture
def running(tmp_path: Path) -> Iterator[Running]:
    base = free_port()
    specs = [_spec("decode", 0, base), _spec("prefill", 0, base + 10)]
    spare = [_spec("decode", i, base) for i in (1, 2)] + [_spec("prefill", 1, base + 10)]
    out = io.StringIO()
    sup = Supervisor(specs, tmp_path, out=out, poll_s=0.05, reserve=spare, drain_timeout=5.0)
    t = threading.Thread(target=sup.run, kwargs={"install_signals": False})
    t.start()
    r = Running(sup, out)
    try:
        r.wait_for("ready    prefill-0")
        yield r
    finally:
        sup.stop_event.set()
        t.join(timeout=30)
        assert not t.is_alive()


def _pids(run_dir: Path) -> dict[str, int]:
    return {p["name"]: p["pid"] for p in json.loads((run_dir / "processes.json").read_text())}


def test_a_replica_starts_in_the_next_slot_and_drains_without_restart(running: Running, tmp_path: Path) -> None:
    sup = running.sup
    assert sup.replicas() == {"decode": 1, "prefill": 1}
    sup.scale({"decode": 3})
    assert sup.replicas() == {"decode": 3, "prefill": 1}  # asked for: counted as starting
    running.wait_for("ready    decode-1")
    running.wait_for("ready    decode-2")
    assert set(_pids(tmp_path)) == {"decode-0", "prefill-0", "decode-1", "decode-2"}
    before = _pids(tmp_path)
    sup.scale({"decode": 1})
    running.wait_for("drained  decode-2 (exited with code 0)")
    running.wait_for("drained  decode-1 (exited with code 0)")
    assert "restart" not in running.out.getvalue()
    assert sup.replicas() == {"decode": 1, "prefill": 1}
    assert _pids(tmp_path) == {"decode-0": before["decode-0"], "prefill-0": before["prefill-0"]}
    # the drained slot is free again: the next start takes it
    said = len(running.out.getvalue())
    sup.scale({"decode": 2})
    running.wait_for("ready    decode-1", after=said)


def test_a_scale_beyond_the_planned_slots_is_refused_whole(running: Running) -> None:
    with pytest.raises(ValueError, match="decode: 4 replicas asked, 3 slots planned"):
        running.sup.scale({"prefill": 2, "decode": 4})
    with pytest.raises(ValueError, match="router cannot be scaled"):
        running.sup.scale({"router": 2})
    assert running.sup.replicas() == {"decode": 1, "prefill": 1}


def test_the_control_endpoint_needs_the_token_and_moves_the_split(running: Running) -> None:
    port = free_port()
    server = serve_control(running.sup, port, "s3cret")
    url = f"http://127.0.0.1:{port}/split"
    auth = {"Authorization": "Bearer s3cret"}
    try:
        assert httpx.get(url).status_code == 401
        assert httpx.post(url, json={"prefill": 2, "decode": 1},
                          headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(url, headers=auth).json() == {"prefill": 1, "decode": 1}
        r = httpx.post(url, json={"prefill": 2, "decode": 1}, headers=auth)
        assert (r.status_code, r.json()) == (202, {"prefill": 2, "decode": 1})
        running.wait_for("ready    prefill-1")
        bad = httpx.post(url, json={"prefill": 1, "decode": -1}, headers=auth)
        assert bad.status_code == 400 and "split.decode" in bad.json()["error"]
        bad = httpx.post(url, json={"prefill": 9, "decode": 1}, headers=auth)
        assert bad.status_code == 400 and "prefill: 9 replicas asked" in bad.json()["error"]
        assert httpx.get(url, headers=auth).json() == {"prefill": 2, "decode": 1}
        assert server.server_address[0] == "127.0.0.1"
    finally:
        server.shutdown()
        server.server_close()


def test_a_scaled_replica_that_keeps_dying_is_given_up_and_the_cluster_goes_on(tmp_path: Path) -> None:
    from services.launcher.restart import RestartPolicy

    base = free_port()
    broken = ProcessSpec(name="decode-1", part="decode", argv=(sys.executable, "-c", "raise SystemExit(3)"),
                         ports=(PortUse("grpc", base + 1, "decode.port"),),
                         ready=Readiness("tcp", "127.0.0.1", base + 1))
    out = io.StringIO()
    sup = Supervisor([_spec("decode", 0, base)], tmp_path, out=out, poll_s=0.05, reserve=[broken],
                     policy=RestartPolicy(backoff_s=0.05, max_quick_restarts=2))
    t = threading.Thread(target=sup.run, kwargs={"install_signals": False})
    t.start()
    r = Running(sup, out)
    try:
        r.wait_for("ready    decode-0")
        sup.scale({"decode": 2})
        r.wait_for("giving it up (it was started by a scale, the cluster goes on without it)")
        assert sup.replicas() == {"decode": 1, "prefill": 0}
        assert t.is_alive() and "stopping the cluster" not in out.getvalue()
        assert set(_pids(tmp_path)) == {"decode-0"}
    finally:
        sup.stop_event.set()
        t.join(timeout=30)
