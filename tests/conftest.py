"""Shared test fixtures. Tests run CPU-only with tiny configs unless marked."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# Two cores on the dev machine and in CI: keep each test process to one torch thread.
torch.set_num_threads(int(os.environ.get("TANDEM_TEST_THREADS", "1")))


@pytest.fixture(autouse=True)
def _dump_tasks_before_timeout(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that is about to hit pytest-timeout prints its asyncio tasks' stacks first."""
    from tests.support.hang_dump import start_timer

    marker = request.node.get_closest_marker("timeout")
    timeout = float(marker.args[0]) if marker and marker.args else float(
        request.config.getini("timeout") or 0)
    if timeout <= 0:
        yield
        return
    timer = start_timer(max(timeout - 15.0, timeout * 0.9))
    try:
        yield
    finally:
        timer.cancel()


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The real SmolLM2 GGUF, where `tandem model pull` puts it. Skips when it is not
    pulled, except under CI, where a missing model is a failure."""
    from services.common.env import in_ci
    from services.model.store import ModelNotFoundError, resolve_model_path

    try:
        return resolve_model_path("auto")
    except ModelNotFoundError as e:
        if in_ci():
            pytest.fail(f"the real model is required under CI: {e}")
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path: Path):
    """The real SmolLM2 tokenizer, loaded once per test run."""
    from services.model.tokenizer import Tokenizer

    return Tokenizer.from_path(smollm2_path)
