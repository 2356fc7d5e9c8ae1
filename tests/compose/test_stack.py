"""The compose stack against a real Docker, as a user meets it (`make compose-test`, which
builds the images and sets COMPOSE_FILE; deploy/compose-test.sh). Skipped otherwise: the
plain test run needs no Docker.

In file order: up from nothing; the API key printed once and required; streamed and unary
chat through the `openai` client; Prometheus holding `tandem_*` series from every part;
Grafana's dashboard and one of its panels' queries; a second decode replica found by
discovery; a second router replica, and the cluster answering through the other while one is
stopped; a killed decode container restarted and the cluster answering again; `down -v`
leaving no container, network or volume.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.skipif(
    os.environ.get("TANDEM_COMPOSE_TEST") != "1",
    reason="needs a Docker daemon and the built images: run `make compose-test`")

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "tandem"
PARTS = ("frontend", "processor", "router", "decode", "prefill")
API = "http://127.0.0.1:8000"
PROMETHEUS = "http://127.0.0.1:9090"
GRAFANA = "http://127.0.0.1:3000"
UP_TIMEOUT_S = 600.0


def compose(*args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    # COMPOSE_FILE (set by make compose-test) names the files, hostnet override included;
    # relative paths in them are relative to the first file's directory
    done = subprocess.run(["docker", "compose", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    if check and done.returncode != 0:
        pytest.fail(f"docker compose {' '.join(args)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return done


def _grafana_image() -> str:
    return os.environ.get("TANDEM_GRAFANA_IMAGE", "grafana/grafana:11.1.0")


def has_grafana() -> bool:
    return subprocess.run(["docker", "image", "inspect", _grafana_image()],
                          capture_output=True).returncode == 0


def wait_for(what: str, probe, timeout: float = 180.0, every: float = 2.0):
    """``probe()``'s first truthy result; fails naming ``what`` (and the last error)."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            got = probe()
            if got:
                return got
        except Exception as e:  # noqa: BLE001 - retried until the deadline, then reported
            last = e
        time.sleep(every)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what} (last error: {last!r})")


def _health() -> dict | None:
    r = httpx.get(f"{API}/health", timeout=5)
    return r.json() if r.status_code == 200 else None


@dataclass
class Stack:
    api_key: str
    up_s: float


def _leftovers() -> dict[str, list[str]]:
    label = f"label=com.docker.compose.project={PROJECT}"
    out = {}
    for kind, cmd in (("containers", ["docker", "ps", "-aq", "--filter", label]),
                      ("networks", ["docker", "network", "ls", "-q", "--filter", label]),
                      ("volumes", ["docker", "volume", "ls", "-q", "--filter", label])):
        out[kind] = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.split()
    return out


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    compose("down", "-v", "--remove-orphans")
    services = ["secrets", "nats", *PARTS, "prometheus", *(["grafana"] if has_grafana() else [])]
    t0 = time.monotonic()
    compose("up", "-d", "--no-build", *services)
    try:
        health = wait_for("the frontend's /health to report ready", _health, UP_TIMEOUT_S, 2.0)
        up_s = time.monotonic() - t0
        print(f"\ncompose-test: up to healthy in {up_s:.0f}s ({health['detail']}), "
              f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        key = compose("exec", "-T", "frontend", "cat", "/secrets/frontend/api_keys").stdout.strip()
        yield Stack(key, up_s)
    finally:
        if os.environ.get("TANDEM_COMPOSE_KEEP") != "1":
            compose("down", "-v", "--remove-orphans", check=False)


def test_secrets_are_printed_once_and_readable_only_by_their_reader(stack: Stack) -> None:
    logs = compose("logs", "--no-color", "secrets").stdout
    assert f"API key (Authorization: Bearer ...): {stack.api_key}" in logs
    assert "Grafana admin password" in logs
    # the processor's user cannot read the frontend's key, nor the frontend the NATS config
    denied = compose("exec", "-T", "processor", "cat", "/secrets/frontend/api_keys", check=False)
    assert denied.returncode != 0 and "Permission denied" in denied.stderr
    denied = compose("exec", "-T", "frontend", "cat", "/secrets/nats/nats-server.conf", check=False)
    assert denied.returncode != 0
    # a second start makes no new secrets and prints none
    again = compose("run", "--rm", "--no-deps", "secrets")
    assert stack.api_key not in again.stdout and "already made" in again.stdout


def test_a_request_without_the_api_key_is_refused(stack: Stack) -> None:
    body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4}
    r = httpx.post(f"{API}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(f"{API}/v1/chat/completions", json=body, timeout=30,
                   headers={"Authorization": "Bearer not-the-key"})
    assert r.status_code == 401


def _client(stack: Stack):
    from openai import OpenAI
    return OpenAI(base_url=f"{API}/v1", api_key=stack.api_key, timeout=120, max_retries=0)


def _chat_once(stack: Stack) -> str:
    client = _client(stack)
    model = client.models.list().data[0].id
    out = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=16,
        temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length")
    assert out.usage.completion_tokens > 0
    return out.choices[0].message.content


def test_the_openai_client_gets_unary_and_streamed_answers(stack: Stack) -> None:
    assert _chat_once(stack).strip()
    client = _client(stack)
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Count to five."}], max_tokens=24,
        temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip() and len([c for c in chunks if c.choices]) > 1
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    # a prompt long enough to be prefilled remotely (configs' max_local_prefill_length)
    long = " ".join(["The quick brown fox jumps over the lazy dog."] * 40)
    out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": long}],
                                         max_tokens=8, temperature=0)
    assert out.usage.prompt_tokens > 256 and out.usage.completion_tokens > 0


def test_the_prefix_cache_reset_reaches_every_worker(stack: Stack) -> None:
    """POST /reset_prefix_cache under the deploy's NATS users: the frontend's may ask on
    {ns}.cache.reset, the decode and prefill workers' may hear it and answer."""
    assert httpx.post(f"{API}/reset_prefix_cache", timeout=30).status_code == 401
    r = httpx.post(f"{API}/reset_prefix_cache", timeout=30,
                   headers={"Authorization": f"Bearer {stack.api_key}"})
    assert r.status_code == 200, r.text
    assert sorted(w["role"] for w in r.json()["workers"]) == ["decode", "prefill"]


def _prom_query(q: str) -> list[dict]:
    r = httpx.get(f"{PROMETHEUS}/api/v1/query", params={"query": q}, timeout=10)
    r.raise_for_status()
    return r.json()["data"]["result"]


def test_prometheus_holds_tandem_series_from_every_part(stack: Stack) -> None:
    def jobs() -> set[str] | None:
        found = {s["metric"]["job"] for s in _prom_query('count by (job) ({__name__=~"tandem_.+"})')}
        return found if set(PARTS) <= found else None

    wait_for("tandem_* series from every part in Prometheus", jobs, 120, 5)
    # the requests above, counted by the frontend, and the long prompt's remote prefill,
    # once the next scrapes have seen them
    def at_least(q: str, n: float) -> bool:
        got = _prom_query(q)
        return bool(got) and float(got[0]["value"][1]) >= n

    wait_for("the chat requests counted", lambda: at_least(
        'sum(tandem_frontend_requests_total{status="200"})', 3), 60, 5)
    wait_for("a remote prefill counted", lambda: at_least(
        'sum(tandem_worker_prefill_total{where="remote"})', 1), 60, 5)


def test_grafana_lists_the_dashboard_and_a_panel_query_returns_data(stack: Stack) -> None:
    if not has_grafana():
        pytest.skip(f"no Grafana image ({_grafana_image()}) here: Grafana is not covered")
    password = compose("run", "--rm", "--no-deps", "--entrypoint", "cat", "secrets",
                       "/secrets/grafana/admin_password").stdout.strip()
    auth = ("admin", password)
    assert httpx.get(f"{GRAFANA}/api/search", timeout=10).status_code == 401
    found = wait_for("the tandem dashboard in Grafana", lambda: [
        d for d in httpx.get(f"{GRAFANA}/api/search", auth=auth, timeout=10).json()
        if d.get("type") == "dash-db"], 120, 3)
    dash = httpx.get(f"{GRAFANA}/api/dashboards/uid/{found[0]['uid']}", auth=auth, timeout=10).json()
    panel = next(p for p in dash["dashboard"]["panels"] if p["title"] == "Queue depth")
    target = panel["targets"][0]
    body = {"from": "now-15m", "to": "now", "queries": [
        {"refId": "A", "datasource": panel["datasource"], "expr": target["expr"],
         "intervalMs": 5000, "maxDataPoints": 100}]}
    r = httpx.post(f"{GRAFANA}/api/ds/query", json=body, auth=auth, timeout=20)
    assert r.status_code == 200, r.text
    frames = r.json()["results"]["A"]["frames"]
    assert frames and frames[0]["data"]["values"], json.dumps(r.json())[:500]


def _discovered(role: str) -> int:
    """How many of ``role`` the frontend's /health counts in discovery."""
    health = _health()
    detail = health["detail"] if health else ""
    part = next((p for p in detail.split(", ") if p.startswith(f"{role}: ")), f"{role}: 0")
    return int(part.split(": ")[1])


def _decode_workers() -> int:
    return _discovered("decode")


def test_a_second_decode_replica_takes_its_own_slot_and_is_discovered(stack: Stack) -> None:
    compose("up", "-d", "--no-build", "--no-recreate", "--scale", "decode=2", "decode")
    wait_for("two decode workers in discovery", lambda: _decode_workers() == 2, 300, 3)
    logs = compose("logs", "--no-color", "decode").stdout
    assert "slot 0" in logs and "slot 1" in logs
    wait_for("both decode replicas scraped", lambda: len(
        _prom_query('up{job="decode"} == 1')) == 2, 60, 5)
    assert _chat_once(stack).strip()


def test_a_second_router_takes_its_own_slot_and_the_cluster_answers_through_either(stack: Stack) -> None:
    compose("up", "-d", "--no-build", "--no-recreate", "--scale", "router=2", "router")
    wait_for("two routers in discovery", lambda: _discovered("router") == 2, 300, 3)
    logs = compose("logs", "--no-color", "router").stdout
    assert "slot 0" in logs and "slot 1" in logs
    wait_for("both routers scraped", lambda: len(_prom_query('up{job="router"} == 1')) == 2, 60, 5)
    # the first router stopped: the processor fails over to the other one
    first = compose("ps", "-q", "router").stdout.split()[0]
    subprocess.run(["docker", "stop", first], check=True, capture_output=True, timeout=120)
    wait_for("one router left in discovery", lambda: _discovered("router") == 1, 120, 3)
    wait_for("an answer through the remaining router", lambda: _chat_once(stack).strip(), 120, 3)
    subprocess.run(["docker", "start", first], check=True, capture_output=True, timeout=120)
    wait_for("two routers again", lambda: _discovered("router") == 2, 300, 3)


def test_a_killed_decode_container_is_restarted_and_the_cluster_answers_again(stack: Stack) -> None:
    (cid, *_) = compose("ps", "-q", "decode").stdout.split()
    pid = subprocess.run(["docker", "inspect", "-f", "{{.State.Pid}}", cid], capture_output=True,
                         text=True, check=True).stdout.strip()
    restarts = int(subprocess.run(["docker", "inspect", "-f", "{{.RestartCount}}", cid],
                                  capture_output=True, text=True, check=True).stdout)
    # a crash, not a stop: SIGKILL to the part's process from the host
    subprocess.run(["kill", "-KILL", pid], check=True)
    wait_for("the decode container to be restarted", lambda: int(subprocess.run(
        ["docker", "inspect", "-f", "{{.RestartCount}}", cid], capture_output=True, text=True,
        check=True).stdout) > restarts, 120, 2)
    wait_for("two decode workers again", lambda: _decode_workers() == 2, 300, 3)
    wait_for("an answer after the restart", lambda: _chat_once(stack).strip(), 120, 3)


def test_down_leaves_no_container_network_or_volume(stack: Stack) -> None:
    compose("down", "-v", "--remove-orphans")
    assert _leftovers() == {"containers": [], "networks": [], "volumes": []}
