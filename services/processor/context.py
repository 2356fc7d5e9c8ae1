"""The context length the processor checks prompts against, without loading the weights.

It is what the decode workers' engines will accept: ``min(engine.max_model_len or the
model's, the model's, num_kv_blocks * block_size)`` (services/engine/scheduler.validate).
"""

from __future__ import annotations

import json
from pathlib import Path

from services.common.config import ClusterConfig


def model_context_length(model_path: Path) -> int:
    """The model's trained context: GGUF ``{arch}.context_length`` or config.json's
    ``max_position_embeddings`` (2048 when absent, as the weight loaders assume)."""
    if model_path.is_file():
        from services.model.gguf_file import open_gguf

        metadata = open_gguf(model_path).metadata
        return int(metadata.get(f"{metadata['general.architecture']}.context_length", 2048))
    cfg = json.loads((model_path / "config.json").read_text(encoding="utf-8"))
    cfg = cfg.get("text_config") or cfg  # a LLaVA model's context is its text model's
    return int(cfg.get("max_position_embeddings", 2048))


def context_length(cfg: ClusterConfig, model_path: Path | None) -> int:
    e = cfg.engine
    if e.runner == "mock" or model_path is None:
        model = e.max_model_len or e.mock.context_length  # what MockRunner.max_model_len is
    else:
        model = model_context_length(model_path)
    return min(e.max_model_len or model, model, e.num_kv_blocks * e.block_size)
