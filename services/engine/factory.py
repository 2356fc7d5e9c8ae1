"""Build an engine from the cluster config: resolve the model, load weights and tokenizer,
pick the runner. The one place that knows how the engine's pieces fit together."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from services.common.config import ClusterConfig
from services.common.kv_events import KvEvent
from services.engine.engine import LLMEngine
from services.engine.model_store import resolve_model_path, served_model_name
from services.engine.runner.base import ModelRunner
from services.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineParts:
    """What a worker process needs: the engine, its tokenizer and the served model name."""

    engine: LLMEngine
    tokenizer: Tokenizer | None
    model_name: str
    model_path: Path | None


def build_runner(cfg: ClusterConfig, model_path: Path | None) -> ModelRunner:
    if cfg.engine.runner == "mock":
        from services.engine.runner.mock_runner import MockRunner

        return MockRunner(cfg.engine)
    from services.engine.runner.torch_runner import TorchRunner
    from services.engine.weights import load_weights

    assert model_path is not None  # NOTE: resolved by build_engine for the torch runner
    loaded = load_weights(model_path)
    if cfg.engine.tensor_parallel_size > 1:
        from services.engine.tp.runner import TpRunner

        return TpRunner(loaded.arch, loaded.tensors, cfg.engine, model_path, cfg.engine.max_model_len)
    return TorchRunner(loaded.arch, loaded.tensors, cfg.engine, cfg.engine.max_model_len, loaded.quant)


def build_engine(
    cfg: ClusterConfig,
    worker_id: str = "",
    on_kv_event: Callable[[KvEvent], None] | None = None,
) -> EngineParts:
    """The engine for ``cfg``. The torch runner needs the model; the mock runner uses the
    model's tokenizer when the model is present (so text still round-trips) and runs
    without one otherwise."""
    model_path: Path | None
    if cfg.engine.runner == "torch":
        model_path = resolve_model_path(cfg.model.path)
    else:
        try:
            model_path = resolve_model_path(cfg.model.path)
        except FileNotFoundError:
            model_path = None
    tokenizer = Tokenizer.from_path(model_path) if model_path is not None else None
    runner = build_runner(cfg, model_path)
    if tokenizer is not None:
        eos: tuple[int, ...] = tokenizer.stop_token_ids
    else:
        eos = (cfg.engine.mock.eos_token_id,)
    grammar = None
    if tokenizer is not None and runner.supports_grammar:
        from services.engine.grammar.compiler import GrammarCompiler

        try:
            grammar = GrammarCompiler(tokenizer.to_json(), runner.vocab_size, eos)
        except ValueError as e:
            # A tokenizer llguidance cannot read (no decoder, say) still serves free text;
            # structured requests then get validate()'s clear 400 instead of a dead worker.
            log.warning("structured output disabled: llguidance cannot use this tokenizer (%s)", e)
    engine = LLMEngine(runner, cfg.engine, eos, worker_id=worker_id, on_kv_event=on_kv_event,
                       grammar=grammar)
    name = cfg.model.name or served_model_name(cfg.model.path)
    return EngineParts(engine, tokenizer, name, model_path)
