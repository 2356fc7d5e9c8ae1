"""NATS locked by default, against a real nats-server started exactly as `tandem up` starts
it (the launcher's plan, users and config writer): each attack of issue 17 is refused, and
every role can still do what its part does (docs/operations.md, "The internal plane")."""

from __future__ import annotations

import asyncio
import signal
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import nats
import nats.errors
import pytest
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from services.common import env
from services.common.config import DiscoveryConfig, NatsConfig, PrefillConfig, parse_config
from services.common.discovery import Discovery, Registration
from services.common.nats_client import (
    ROLES,
    NatsAuthError,
    NatsClient,
    Subjects,
    connect,
    flush,
    inbox_prefix,
)
from services.disagg.prefill_queue import ensure_prefill_queue
from services.launcher.nats import find_nats_server, tcp_accepts
from services.launcher.nats_auth import deploy_password, lock_nats, password_var
from services.launcher.plan import plan
from tests.support.ports import free_port
from tests.support.procs import needs_nats_server

pytestmark = pytest.mark.asyncio

NS = "lockns"
S = Subjects(NS)
DISC = DiscoveryConfig(ttl_s=10, heartbeat_s=3)
DEPLOY_CONF = Path(__file__).resolve().parents[3] / "deploy" / "nats" / "nats-server.conf"


@dataclass
class Locked:
    url: str
    users: dict[str, tuple[str, str]]  # process name -> (user, password)
    log: Path


@pytest.fixture(scope="module")
def locked(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Locked]:
    """nats-server with the config `tandem up` writes for 2 decode + 1 prefill workers."""
    needs_nats_server()
    run = tmp_path_factory.mktemp("run")
    port = free_port()
    cfg = parse_config({"namespace": NS, "nats": {"url": f"nats://127.0.0.1:{port}"},
                        "engine": {"runner": "mock"}, "decode": {"replicas": 2}})
    specs = lock_nats(cfg, plan(cfg, None, nats_data_dir=run / "nats", nats_binary=find_nats_server()), run)
    log = run / "nats-server.log"
    with log.open("w") as out:
        proc = subprocess.Popen(list(specs[0].argv), stdout=out, stderr=subprocess.STDOUT)
    try:
        for _ in range(200):
            if tcp_accepts("127.0.0.1", port):
                break
            assert proc.poll() is None, log.read_text()
            subprocess.run(["sleep", "0.05"], check=True)
        users = {s.name: (s.env[env.NATS_USER], s.env[env.NATS_PASSWORD]) for s in specs[1:]}
        yield Locked(cfg.nats.url, users, log)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=10)


@dataclass
class Client:
    nc: NatsClient
    errors: list[str]

    def js(self):  # noqa: ANN201 - nats-py's JetStreamContext
        # NOTE: a refused JetStream request only times out; keep that short.
        return self.nc.jetstream(timeout=1.0)

    def violations(self) -> list[str]:
        return [e for e in self.errors if "permissions violation" in e.lower()]


@asynccontextmanager
async def client(locked: Locked, name: str) -> AsyncIterator[Client]:
    """A connection as process ``name``'s user that records the server's errors."""
    user, password = locked.users[name]
    errors: list[str] = []

    async def on_error(e: Exception) -> None:
        errors.append(str(e))

    nc = await nats.connect(locked.url, user=user, password=password, name=name,
                            inbox_prefix=inbox_prefix(user), error_cb=on_error,
                            allow_reconnect=False)
    try:
        yield Client(nc, errors)
    finally:
        await nc.close()


async def _until(done: Callable[[], object], what: str | Callable[[], str],
                 timeout: float = 10.0) -> None:
    """Wait for deliveries and the server's -ERR lines (asynchronous) until ``done()``;
    the timeout only keeps a broken run from hanging."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not done():
        assert asyncio.get_running_loop().time() < deadline, \
            f"never saw {what() if callable(what) else what}"
        await asyncio.sleep(0.01)


async def test_anonymous_and_wrong_passwords_are_refused(locked: Locked,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    for var in (env.NATS_USER, env.NATS_PASSWORD, env.NATS_TOKEN):
        monkeypatch.delenv(var, raising=False)
        monkeypatch.delenv(var + env.FILE_SUFFIX, raising=False)
    with pytest.raises(NatsAuthError, match="no credentials"):
        await connect(NatsConfig(url=locked.url), "anonymous")
    user, _ = locked.users["router"]
    with pytest.raises(NatsAuthError, match="user/password"):
        await connect(NatsConfig(url=locked.url, user=user, password="guess"), "guesser")


async def test_every_role_does_its_part(locked: Locked) -> None:
    """What the parts do, each as its own user, with no permission violation: discovery,
    KV events, load, dumps, in-flight updates, the prefill queue both ways."""
    async with (client(locked, "decode-0") as dec, client(locked, "router") as rtr,
                client(locked, "processor") as proc, client(locked, "frontend") as fe,
                client(locked, "prefill-0") as pre):
        got: dict[str, list[bytes]] = {"events": [], "load": [], "inflight": []}
        await rtr.nc.subscribe(S.kv_events_all, cb=collect(got["events"]))
        await rtr.nc.subscribe(S.load_all, cb=collect(got["load"]))
        await rtr.nc.subscribe(S.router_inflight, cb=collect(got["inflight"]))

        async def dump(msg: Msg) -> None:
            await msg.respond(b"the dump")

        await dec.nc.subscribe(S.kv_dump("decode-0"), cb=dump)
        await flush(dec.nc)
        await flush(rtr.nc)

        # discovery: every part registers its own key; watchers see decode-0
        leases = []
        for c, role, iid in ((dec, "decode", "decode-0"), (rtr, "router", "router-0"),
                             (proc, "processor", "processor-0"), (fe, "frontend", "frontend-0"),
                             (pre, "prefill", "prefill-0")):
            disc = await Discovery.open(c.nc, NS, DISC)
            leases.append(await disc.register(Registration(role, iid, address="127.0.0.1:1")))
        for c in (rtr, fe, proc):
            watch = (await Discovery.open(c.nc, NS, DISC)).watch("decode")
            ev = await asyncio.wait_for(anext(watch), 5)
            assert (ev.kind, ev.registration.instance_id) == ("join", "decode-0")
            await watch.aclose()

        await dec.nc.publish(S.kv_events("decode-0"), b"events")
        await dec.nc.publish(S.load("decode-0"), b"load")
        await proc.nc.publish(S.router_inflight, b"from a processor")
        await rtr.nc.publish(S.router_inflight, b"from a router")
        assert (await rtr.nc.request(S.kv_dump("decode-0"), b"", timeout=2)).data == b"the dump"

        # the prefill queue: decode creates it and publishes, prefill pulls and acks
        await ensure_prefill_queue(dec.js(), S, PrefillConfig())
        await ensure_prefill_queue(pre.js(), S, PrefillConfig())
        await dec.js().publish(S.prefill_queue, b"job-1")
        seq = (await dec.js().publish(S.prefill_queue, b"job-2")).seq
        assert await dec.js().delete_msg(S.prefill_stream, seq)  # a cancelled job retracted
        psub = await pre.js().pull_subscribe_bind(durable=S.prefill_consumer, stream=S.prefill_stream)
        (job,) = await psub.fetch(1, timeout=2)
        assert job.data == b"job-1"
        await job.in_progress()
        await job.ack()
        await flush(pre.nc)
        info = await dec.js().consumer_info(S.prefill_stream, S.prefill_consumer)  # queue depth
        assert info.num_pending == 0

        for lease in leases:
            await lease.close()
        await _until(lambda: got["events"] and got["load"] and len(got["inflight"]) == 2,
                     "every legitimate message")
        assert got["events"] == [b"events"] and got["load"] == [b"load"]
        assert sorted(got["inflight"]) == [b"from a processor", b"from a router"]
        for c in (dec, rtr, proc, fe, pre):
            assert c.violations() == [], c.errors


def collect(into: list[bytes]) -> Callable[[Msg], Awaitable[None]]:
    """A subscription callback that appends each message's payload to ``into``."""
    async def cb(msg: Msg) -> None:
        into.append(msg.data)
    return cb


async def _decode_0_registered(dec: Client) -> Discovery:
    disc = await Discovery.open(dec.nc, NS, DISC)
    await disc.register(Registration("decode", "decode-0", address="10.0.0.1:9300"))
    return disc


async def test_only_decode_0_can_write_its_discovery_key(locked: Locked) -> None:
    """The tester's attack: re-put decode.decode-0 with another address, or delete it."""
    async with (client(locked, "decode-0") as dec, client(locked, "processor") as proc,
                client(locked, "frontend") as fe, client(locked, "decode-1") as dec1):
        await _decode_0_registered(dec)
        for attacker in (proc, fe, dec1):
            kv = await attacker.js().key_value(S.discovery_bucket)
            evil = Registration("decode", "decode-0", address="evil:9300").to_bytes()
            with pytest.raises(nats.errors.TimeoutError):
                await kv.put("decode.decode-0", evil)
            with pytest.raises(nats.errors.TimeoutError):
                await kv.delete("decode.decode-0")
            assert any("$kv.lockns_discovery.decode.decode-0" in v.lower() for v in attacker.violations())
        entry = await (await dec.js().key_value(S.discovery_bucket)).get("decode.decode-0")
        assert Registration.from_bytes(entry.value).address == "10.0.0.1:9300"


async def test_no_part_can_make_the_server_deliver_forged_messages(locked: Locked) -> None:
    """A push consumer delivers to any subject its creator names: a frontend that could
    create one on the bucket could send its own key's value to decode-0's event subject."""
    async with client(locked, "frontend") as fe, client(locked, "router") as rtr:
        got: list[bytes] = []
        await rtr.nc.subscribe(S.kv_events("decode-0"), cb=collect(got))
        await flush(rtr.nc)
        await Discovery.open(fe.nc, NS, DISC)  # the bucket exists
        kv = await fe.js().key_value(S.discovery_bucket)
        await kv.put("frontend.frontend-0", b"forged KV event batch")
        with pytest.raises(nats.errors.TimeoutError):
            await fe.js()._jsm.add_consumer(S.discovery_stream, ConsumerConfig(
                deliver_subject=S.kv_events("decode-0"), ack_policy=AckPolicy.NONE,
                deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
                filter_subject=S.discovery_key("frontend", "frontend-0")))
        await _until(fe.violations, "the frontend's violation")
        await flush(rtr.nc)  # a delivery the server had made would be in by now
        assert got == []


async def test_the_prefill_queue_is_read_by_prefill_workers_alone(locked: Locked) -> None:
    async with (client(locked, "decode-0") as dec, client(locked, "frontend") as fe,
                client(locked, "prefill-0") as pre):
        await ensure_prefill_queue(dec.js(), S, PrefillConfig())
        heard: list[bytes] = []
        await fe.nc.subscribe(S.prefill_queue, cb=collect(heard))  # the prompt subject
        await fe.nc.subscribe("_INBOX.prefill-0.>", cb=collect(heard))  # its deliveries
        await flush(fe.nc)
        await dec.js().publish(S.prefill_queue, b"a prompt")
        with pytest.raises(nats.errors.TimeoutError):
            await fe.js().get_msg(S.prefill_stream, seq=1)
        # a decode worker publishes jobs but may not pull them
        psub = await dec.js().pull_subscribe_bind(durable=S.prefill_consumer, stream=S.prefill_stream)
        with pytest.raises(nats.errors.TimeoutError):
            await psub.fetch(1, timeout=1)
        await _until(lambda: len(fe.violations()) >= 3 and dec.violations(), "the violations")
        await flush(fe.nc)
        assert heard == []
        psub = await pre.js().pull_subscribe_bind(durable=S.prefill_consumer, stream=S.prefill_stream)
        (job,) = await psub.fetch(1, timeout=2)
        assert job.data == b"a prompt"
        await job.ack()
        await flush(pre.nc)


async def test_decode_0_cannot_speak_for_decode_1(locked: Locked) -> None:
    async with client(locked, "decode-0") as dec, client(locked, "router") as rtr:
        got: list[bytes] = []
        await rtr.nc.subscribe(S.kv_events_all, cb=collect(got))
        await rtr.nc.subscribe(S.load_all, cb=collect(got))
        await flush(rtr.nc)
        await dec.nc.publish(S.kv_events("decode-1"), b"forged events")
        await dec.nc.publish(S.load("decode-1"), b"forged load")
        await dec.nc.subscribe(S.kv_dump("decode-1"))  # would answer decode-1's dumps
        await dec.nc.publish(S.kv_events("decode-0"), b"own events")
        # NOTE: one connection's messages arrive in order: a forged batch the server had let
        # through would be in ``got`` before the own one.
        await _until(lambda: got and len(dec.violations()) >= 3,
                     lambda: f"own events and 3 violations (got {got}, errors {dec.errors})")
        assert got == [b"own events"]
        assert len(dec.violations()) == 3, dec.errors


@pytest.fixture(scope="module")
def deploy_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, str]]]:
    """nats-server with the deploys' config (deploy/nats/nats-server.conf, a user per role)
    and its passwords in its environment, as compose and k8s run it."""
    needs_nats_server()
    store = tmp_path_factory.mktemp("deploy-nats")
    port = free_port()
    passwords = {r: deploy_password() for r in ROLES}
    with (store / "nats-server.log").open("w") as out:
        proc = subprocess.Popen(
            [find_nats_server(), "-c", str(DEPLOY_CONF), "-js", "-sd", str(store), "-p", str(port),
             "-a", "127.0.0.1"], env={password_var(r): pw for r, pw in passwords.items()},
            stdout=out, stderr=subprocess.STDOUT)
    try:
        for _ in range(200):
            if tcp_accepts("127.0.0.1", port):
                break
            assert proc.poll() is None, (store / "nats-server.log").read_text()
            subprocess.run(["sleep", "0.05"], check=True)
        yield f"nats://127.0.0.1:{port}", passwords
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=10)


async def test_deploy_parts_log_in_with_a_password_file(deploy_url: tuple[str, dict[str, str]],
                                                        tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A part run standalone (compose, k8s) gets its role's user and password file from the
    environment; role-wide users may act as any instance of their role, and only that."""
    url, passwords = deploy_url
    monkeypatch.delenv(env.NATS_PASSWORD, raising=False)
    monkeypatch.delenv(env.NATS_TOKEN, raising=False)
    for role, password in passwords.items():
        (tmp_path / role).write_text(password + "\n")
        monkeypatch.setenv(env.NATS_USER, role)
        monkeypatch.setenv(env.NATS_PASSWORD + env.FILE_SUFFIX, str(tmp_path / role))
        nc = await connect(NatsConfig(url=url), role)
        try:
            disc = await Discovery.open(nc, "tandem", DISC)
            lease = await disc.register(Registration(role, f"{role}-7"))
            await lease.close()
            other = "router" if role != "router" else "decode"
            kv = await nc.jetstream(timeout=1.0).key_value("tandem_discovery")
            with pytest.raises(nats.errors.TimeoutError):
                await kv.put(f"{other}.{other}-0", b"{}")
        finally:
            await nc.close()
    monkeypatch.delenv(env.NATS_USER)
    monkeypatch.delenv(env.NATS_PASSWORD + env.FILE_SUFFIX)
    with pytest.raises(NatsAuthError):
        await connect(NatsConfig(url=url), "anonymous")
