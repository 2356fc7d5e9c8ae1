"""The processor's context length for the mock runner is what the decode engine accepts."""

from __future__ import annotations

import pytest

from services.common.config import parse_config
from services.engine.engine import LLMEngine
from services.engine.runner.mock_runner import MockRunner
from services.processor.context import context_length


@pytest.mark.parametrize("engine", [
    {},  # the mock model's default context (8192), capped by the pool: 2048 * 16
    {"num_kv_blocks": 100},  # the pool caps it: 1600
    {"mock": {"context_length": 300}},
    {"max_model_len": 500, "mock": {"context_length": 300}},  # a set max_model_len replaces it
])
def test_mock_context_length_matches_the_engine(engine: dict) -> None:
    cfg = parse_config({"engine": {"runner": "mock", **engine}})
    eng = LLMEngine(MockRunner(cfg.engine), cfg.engine, [2])
    assert context_length(cfg, None) == eng.scheduler.max_model_len
