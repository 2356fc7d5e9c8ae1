"""A Hugging Face config.json read into the text model's architecture (torch-free: the
processor reads it too, for a LLaVA model's image placeholders)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from services.model.arch import ModelArchConfig
from services.model.errors import UnsupportedModelError

# HF `architectures[0]` -> our architecture name.
SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise UnsupportedModelError(f"{path} is not valid JSON: {e}") from e


def _rope_theta(cfg: dict[str, Any], where: Path) -> float:
    # transformers >= 5 writes rope_parameters; older configs write rope_theta + rope_scaling.
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise UnsupportedModelError(f"rope type {rope_type!r} in {where} is not supported")
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def arch_from_config(cfg: dict[str, Any], where: Path) -> ModelArchConfig:
    """Build ModelArchConfig from a config.json dict; `where` names the file in errors."""
    names = cfg.get("architectures") or []
    hf_arch = names[0] if names else None
    if hf_arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"architecture {hf_arch!r} in {where} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    arch = SUPPORTED_ARCHITECTURES[hf_arch]
    if arch == "llama" and (cfg.get("attention_bias") or cfg.get("mlp_bias")):
        raise UnsupportedModelError(f"{where}: Llama attention_bias/mlp_bias is not supported")
    if arch == "qwen2" and cfg.get("use_sliding_window"):
        raise UnsupportedModelError(f"{where}: Qwen2 sliding-window attention is not supported")
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    return ModelArchConfig(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rope_theta=_rope_theta(cfg, where),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=arch == "qwen2",  # Qwen2's q/k/v projections always carry a bias
    )
