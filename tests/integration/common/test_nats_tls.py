"""NATS over TLS (docs/operations.md, "TLS"): a nats-server with a certificate from a
private CA; a part trusts it through nats.tls_ca, and without it refuses the server."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.common.config import DiscoveryConfig, NatsConfig
from services.common.discovery import Discovery, Registration
from services.common.nats_client import NatsTlsError, connect
from tests.support.procs import NatsServer, needs_nats_server

pytestmark = pytest.mark.asyncio


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_certs(d: Path) -> None:
    """ca.pem, and server.pem/server.key for 127.0.0.1 signed by it."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=tandem test CA",
             "-keyout", "ca.key", "-out", "ca.pem", cwd=d)
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
             "-keyout", "server.key", "-out", "server.csr", cwd=d)
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
             "-CAcreateserial", "-days", "2", "-extfile", "san.ext", "-out", "server.pem", cwd=d)


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    needs_nats_server()
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    certs = tmp_path_factory.mktemp("certs")
    make_certs(certs)
    server = NatsServer(tmp_path_factory.mktemp("nats"),
                        args=("--tls", "--tlscert", str(certs / "server.pem"),
                              "--tlskey", str(certs / "server.key")))
    server.start()
    yield f"tls://127.0.0.1:{server.port}", certs / "ca.pem"
    server.stop()


async def test_a_part_trusts_the_server_through_its_ca(tls_server: tuple[str, Path]) -> None:
    url, ca = tls_server
    nc = await connect(NatsConfig(url=url, tls_ca=str(ca)), "tls-test")
    try:
        disc = await Discovery.open(nc, "tlsns", DiscoveryConfig())
        lease = await disc.register(Registration("decode", "decode-0", address="x:1"))
        await lease.close()
        assert nc.is_connected
    finally:
        await nc.close()


async def test_a_server_signed_by_an_unknown_ca_is_refused(tls_server: tuple[str, Path]) -> None:
    url, _ = tls_server
    with pytest.raises(NatsTlsError, match="does not trust.*set nats.tls_ca"):
        await connect(NatsConfig(url=url), "tls-test")
