"""router.mode is a RouterMode: an unknown value is an error naming it, never a silent
fallback to another mode."""

from __future__ import annotations

import pytest

from services.api.route import RouteRequest
from services.common.config import ConfigError, RouterMode, parse_config
from services.common.discovery import Registration
from services.router.router import Router


def test_an_unknown_mode_is_refused_by_the_config_and_by_the_router() -> None:
    with pytest.raises(ConfigError, match=r"router\.mode: Input should be 'kv', 'ttft', 'round_robin' or 'random'"):
        parse_config({"router": {"mode": "rand"}})
    cfg = parse_config({})
    # model_copy(update=...) skips validation: the router checks again
    bad = cfg.model_copy(update={"router": cfg.router.model_copy(update={"mode": "rand"})})
    with pytest.raises(ValueError, match=r"router\.mode 'rand' is not one of 'kv', 'ttft', 'round_robin', 'random'"):
        Router(bad)


@pytest.mark.parametrize("mode", list(RouterMode))
async def test_every_mode_routes(mode: RouterMode) -> None:
    router = Router(parse_config({"router": {"mode": mode.value}}), seed=0)
    assert router.mode is mode
    for w in ("w0", "w1"):
        router.worker_joined(Registration("decode", w, address=f"{w}:1"))
    picked = [(await router.route(RouteRequest(f"r{i}", [1, 2, 3, i]))).worker_id for i in range(4)]
    assert set(picked) <= {"w0", "w1"}
    if mode is RouterMode.ROUND_ROBIN:
        assert picked == ["w0", "w1", "w0", "w1"]
