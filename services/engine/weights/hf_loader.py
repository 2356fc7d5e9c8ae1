"""Read a Hugging Face model directory (config.json + safetensors) into float32 tensors."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from services.engine.weights.layout import check_tensors
from services.engine.weights.loaded import LoadedWeights
from services.model.hf_config import arch_from_config, read_json


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files: the shards listed in model.safetensors.index.json, else
    model.safetensors, else the directory's only *.safetensors file."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(read_json(index)["weight_map"].values()))
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
    arch = arch_from_config(read_json(cfg_path), cfg_path)
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
