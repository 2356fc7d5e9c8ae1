"""A real nats-server (JetStream on) per test module, and the bounded wait as a fixture."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.support.procs import NatsServer, needs_nats_server
from tests.support.waits import eventually


@pytest.fixture(scope="module")
def nats_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    needs_nats_server()
    server = NatsServer(tmp_path_factory.mktemp("nats"))
    server.start()
    yield server.url
    died = server.died()
    server.stop()
    assert died is None, died


@pytest.fixture
def wait_for() -> Callable[..., object]:
    """The ``eventually`` helper as a fixture (test modules do not import conftest)."""
    return eventually
