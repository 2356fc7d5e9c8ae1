"""Read a Hugging Face model directory (config.json + safetensors) into float32 tensors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from services.engine.model_config import ModelArchConfig
from services.engine.model_errors import UnsupportedModelError
from services.engine.weights.layout import check_tensors
from services.engine.weights.loaded import LoadedWeights

# HF `architectures[0]` -> our architecture name.
SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}


def _read_json(path: Path) -> dict[str, Any]:
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


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files: the shards listed in model.safetensors.index.json, else
    model.safetensors, else the directory's only *.safetensors file."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(_read_json(index)["weight_map"].values()))
        files = [model_dir / s for s in shards]
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"shard {f} listed in {index} is missing")
        return files
    if (model_dir / "model.safetensors").is_file():
        return [model_dir / "model.safetensors"]
    found = sorted(model_dir.glob("*.safetensors"))
    if len(found) == 1:
        return found
    raise FileNotFoundError(
        f"{model_dir} has no model.safetensors or model.safetensors.index.json "
        f"(found {[f.name for f in found]}; only safetensors weights are supported)"
    )


def load_hf_dir(model_dir: Path) -> LoadedWeights:
    """Load a LlamaForCausalLM / Qwen2ForCausalLM directory; see LoadedWeights for the contract."""
    cfg_path = model_dir / "config.json"
    arch = arch_from_config(_read_json(cfg_path), cfg_path)
    tensors: dict[str, torch.Tensor] = {}
    for f in safetensors_files(model_dir):
        for name, t in load_file(f, device="cpu").items():
            # Old checkpoints carry the rotary cache as a buffer; it is derived, not a weight.
            if name.endswith("rotary_emb.inv_freq"):
                continue
            tensors[name] = t.to(torch.float32).contiguous()
    if arch.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    check_tensors(arch, tensors, model_dir)
    return LoadedWeights(arch=arch, tensors=tensors, source=model_dir)
