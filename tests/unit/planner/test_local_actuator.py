"""The local actuator against the launcher's control endpoint (a supervisor stand-in): the
split read and asked for, the launcher's refusals surfaced with its reason."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from services.launcher.control import serve_control
from services.planner.actuators.local import ControlEndpointError, LocalActuator
from services.planner.decision import Split
from tests.support.ports import free_port


class Stand:
    def __init__(self) -> None:
        self.counts = {"prefill": 1, "decode": 2}

    def replicas(self) -> dict[str, int]:
        return dict(self.counts)

    def scale(self, counts: dict[str, int]) -> None:
        if counts["decode"] > 4:
            raise ValueError(f"decode: {counts['decode']} replicas asked, 4 slots planned")
        self.counts.update(counts)


@pytest.fixture
def port() -> Iterator[int]:
    p = free_port()
    server = serve_control(Stand(), p, "tok")
    yield p
    server.shutdown()
    server.server_close()


async def test_reads_and_moves_the_split(port: int) -> None:
    act = LocalActuator(port, "tok")
    try:
        assert await act.current() == Split(1, 2)
        await act.apply(Split(0, 3))
        assert await act.current() == Split(0, 3)
        with pytest.raises(ControlEndpointError, match="400: decode: 5 replicas asked, 4 slots planned"):
            await act.apply(Split(0, 5))
    finally:
        await act.close()


async def test_a_wrong_token_or_no_launcher_is_an_error_naming_it(port: int) -> None:
    act = LocalActuator(port, "wrong")
    with pytest.raises(ControlEndpointError, match="401: the cluster token is required"):
        await act.current()
    await act.close()
    nobody = LocalActuator(free_port(), "tok")
    with pytest.raises(ControlEndpointError, match="control endpoint http://127.0.0.1:"):
        await nobody.current()
    await nobody.close()
