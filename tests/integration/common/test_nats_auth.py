"""NATS credentials from the config or the environment, against a real nats-server that
requires them (``--user/--pass`` and ``--auth``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from services.common.config import DiscoveryConfig, NatsConfig
from services.common.discovery import Discovery, Registration
from services.common.nats_client import NatsAuthError, connect
from tests.support.procs import NatsServer, needs_nats_server

pytestmark = pytest.mark.asyncio


def _server(store: Path, *auth: str) -> Iterator[str]:
    needs_nats_server()
    server = NatsServer(store, args=auth)
    server.start()
    yield server.url
    server.stop()


@pytest.fixture(scope="module")
def userpass_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from _server(tmp_path_factory.mktemp("nats"), "--user", "tandem-u", "--pass", "s3cret-pw")


@pytest.fixture(scope="module")
def token_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from _server(tmp_path_factory.mktemp("nats"), "--auth", "tok-123456")


async def _works(cfg: NatsConfig) -> None:
    """A part's first steps: connect, open discovery (JetStream KV), register."""
    nc = await connect(cfg, "auth-test")
    try:
        disc = await Discovery.open(nc, "authns", DiscoveryConfig())
        lease = await disc.register(Registration("decode", "d0", address="x:1"))
        await lease.close()
        assert nc.is_connected
    finally:
        await nc.close()


async def test_user_password_from_config_and_from_env(userpass_url: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    await _works(NatsConfig(url=userpass_url, user="tandem-u", password="s3cret-pw"))
    monkeypatch.setenv("TANDEM_NATS_USER", "tandem-u")
    monkeypatch.setenv("TANDEM_NATS_PASSWORD", "s3cret-pw")
    await _works(NatsConfig(url=userpass_url))


async def test_missing_or_wrong_password_fails_clearly(userpass_url: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TANDEM_NATS_USER", raising=False)
    monkeypatch.delenv("TANDEM_NATS_PASSWORD", raising=False)
    with pytest.raises(NatsAuthError, match="no credentials.*TANDEM_NATS_USER"):
        await connect(NatsConfig(url=userpass_url), "auth-test")
    with pytest.raises(NatsAuthError, match="user/password"):
        await connect(NatsConfig(url=userpass_url, user="tandem-u", password="wrong"), "auth-test")


async def test_token_from_env(token_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_NATS_TOKEN", "tok-123456")
    await _works(NatsConfig(url=token_url))
    monkeypatch.delenv("TANDEM_NATS_TOKEN")
    with pytest.raises(NatsAuthError, match="no credentials"):
        await connect(NatsConfig(url=token_url), "auth-test")
