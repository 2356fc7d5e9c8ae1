"""`tandem up` of a mock cluster under NATS auth, end to end: every part logs in as its own
user and a chat request (a remote prefill included) is answered with no permission
violation anywhere; no secret is on a command line; an anonymous client is refused."""

from __future__ import annotations

import json
import re
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from services.common import env
from services.common.config import NatsConfig
from services.common.nats_client import NatsAuthError, connect
from tests.support.ports import free_port, free_port_pair
from tests.support.procs import needs_nats_server

ROOT = Path(__file__).resolve().parents[3]
API_KEY = "k-up-locked-test"
VIOLATION = re.compile(r"(publish|subscription|permissions) violation", re.IGNORECASE)


@dataclass
class Up:
    proc: subprocess.Popen[str]
    run_dir: Path
    out: list[str]
    front: int
    nats_url: str
    decode_metrics: int


def _read_until(up: subprocess.Popen[str], marker: str, into: list[str]) -> None:
    assert up.stdout is not None
    for line in up.stdout:
        into.append(line.rstrip("\n"))
        if marker in line:
            return
    raise AssertionError(f"{marker!r} never printed:\n" + "\n".join(into))


@pytest.fixture(scope="module")
def up(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    needs_nats_server()
    run_dir = tmp_path_factory.mktemp("run")
    nats, front, dec_m = free_port(), free_port(), free_port()
    overrides = [
        f"nats.url=nats://127.0.0.1:{nats}", f"router.port={free_port()}",
        f"router.metrics_port={free_port()}", f"decode.port={free_port()}",
        f"decode.metrics_port={dec_m}", f"prefill.metrics_port={free_port_pair()}",
        f"processor.port={free_port()}", f"processor.metrics_port={free_port()}",
        f"frontend.port={front}", "engine.runner=mock",
        "decode.disagg.max_local_prefill_length=16", "decode.disagg.policy=threshold",
        f"frontend.api_keys=[{API_KEY}]",
    ]
    argv = [sys.executable, "-m", "services.cli", "up", "-c", "configs/local.yaml",
            "--run-dir", str(run_dir), "--ready-timeout", "240"]
    for o in overrides:
        argv += ["--set", o]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    out: list[str] = []
    try:
        _read_until(proc, "tandem is ready", out)
        yield Up(proc, run_dir, out, front, f"nats://127.0.0.1:{nats}", dec_m)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_a_chat_request_is_answered_with_a_remote_prefill(up: Up) -> None:
    body = {"model": "SmolLM2-135M-Instruct", "max_tokens": 4,
            "messages": [{"role": "user", "content": "tell me about the city of Paris " * 12}]}
    url = f"http://127.0.0.1:{up.front}/v1/chat/completions"
    assert httpx.post(url, json=body, timeout=60).status_code == 401  # the key reached it
    r = httpx.post(url, json=body, timeout=60, headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200, r.text
    metrics = httpx.get(f"http://127.0.0.1:{up.decode_metrics}/metrics", timeout=10).text
    assert 'tandem_worker_prefill_total{where="remote"} 1.0' in metrics


def test_secrets_are_off_every_command_line_and_the_config_is_private(up: Up) -> None:
    conf = up.run_dir / "nats-server.conf"
    assert stat.S_IMODE(conf.stat().st_mode) == 0o600
    text = conf.read_text()
    passwords = [line.split('password: "')[1].split('"')[0] for line in text.splitlines()
                 if 'password: "' in line]
    assert len(passwords) == 5  # router, decode-0, prefill-0, processor, frontend
    for p in json.loads((up.run_dir / "processes.json").read_text()):
        cmdline = " ".join(p["argv"])
        assert API_KEY not in cmdline and not any(pw in cmdline for pw in passwords), p["name"]
        environ = Path(f"/proc/{p['pid']}/environ")
        if p["name"] != "nats" and environ.exists():
            variables = dict(v.split("=", 1) for v in environ.read_text().split("\0") if "=" in v)
            assert variables[env.NATS_USER] == p["name"]
            assert (env.API_KEYS in variables) == (p["name"] == "frontend")


async def test_an_anonymous_client_is_refused(up: Up, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in (env.NATS_USER, env.NATS_PASSWORD, env.NATS_TOKEN):
        monkeypatch.delenv(var, raising=False)
        monkeypatch.delenv(var + env.FILE_SUFFIX, raising=False)
    with pytest.raises(NatsAuthError):
        await connect(NatsConfig(url=up.nats_url), "anonymous")


def test_no_permission_violation_and_a_clean_stop(up: Up) -> None:
    up.proc.send_signal(signal.SIGTERM)
    rest, _ = up.proc.communicate(timeout=90)
    out = "\n".join(up.out) + rest
    assert up.proc.returncode == 0, out
    logs = {p.name: p.read_text(errors="replace") for p in (up.run_dir / "logs").glob("*.log")}
    assert set(logs) == {"nats.log", "router.log", "decode-0.log", "prefill-0.log",
                         "processor.log", "frontend.log"}
    for name, text in logs.items():
        # nats-server: "Publish Violation", "Subscription Violation"; nats-py: "permissions
        # violation". (The refused anonymous client above is an authorization error.)
        assert not VIOLATION.search(text), f"{name}:\n{text[-3000:]}"
