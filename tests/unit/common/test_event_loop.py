"""Every part runs on uvloop where it is installed; TANDEM_EVENT_LOOP=asyncio opts out."""

from __future__ import annotations

import asyncio

import pytest
import uvloop

from services.common.service import event_loop_factory


def test_parts_run_on_uvloop_unless_asked_not_to(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TANDEM_EVENT_LOOP", raising=False)
    factory = event_loop_factory()
    assert factory is not None
    with asyncio.Runner(loop_factory=factory) as runner:
        assert isinstance(runner.get_loop(), uvloop.Loop)
    monkeypatch.setenv("TANDEM_EVENT_LOOP", "asyncio")
    assert event_loop_factory() is None
