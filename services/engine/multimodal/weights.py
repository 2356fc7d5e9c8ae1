"""Read a LLaVA Hugging Face directory: the text model's tensors (as a Llama/Qwen2
checkpoint names them), the vision tower's and the projector's."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from services.engine.weights.hf_loader import safetensors_files
from services.engine.weights.layout import check_tensors
from services.engine.weights.loaded import LoadedWeights
from services.model.errors import UnsupportedModelError
from services.model.llava_config import LlavaArchConfig, llava_from_config

# Checkpoint prefix -> (part, prefix in that part's naming). Older checkpoints (and
# transformers' save_pretrained) write the first form of each, newer the ``model.`` one.
_PREFIXES = (
    ("language_model.model.", "text", "model."),
    ("language_model.lm_head.", "text", "lm_head."),
    ("model.language_model.", "text", "model."),
    ("lm_head.", "text", "lm_head."),
    ("vision_tower.vision_model.", "vision", ""),
    ("model.vision_tower.vision_model.", "vision", ""),
    ("model.vision_tower.", "vision", ""),
    ("vision_tower.", "vision", ""),
    ("model.multi_modal_projector.", "projector", ""),
    ("multi_modal_projector.", "projector", ""),
)


@dataclass(frozen=True)
class LlavaWeights:
    arch: LlavaArchConfig
    text: LoadedWeights  # checked against the Llama/Qwen2 layout, like a text-only model
    vision: dict[str, torch.Tensor]  # named from ``embeddings.`` down
    projector: dict[str, torch.Tensor]  # ``linear_1.weight``...


def split_llava_tensors(tensors: dict[str, torch.Tensor]) -> tuple[dict, dict, dict]:
    """Checkpoint-named tensors -> (text, vision, projector), each in its part's naming."""
    parts: dict[str, dict[str, torch.Tensor]] = {"text": {}, "vision": {}, "projector": {}}
    for name, t in tensors.items():
        for prefix, part, new in _PREFIXES:
            if name.startswith(prefix):
                parts[part][new + name[len(prefix):]] = t
                break
        else:
            raise UnsupportedModelError(f"tensor {name!r} belongs to no part of a LLaVA model")
    return parts["text"], parts["vision"], parts["projector"]


def read_llava_arch(model_dir: Path) -> LlavaArchConfig:
    cfg_path = model_dir / "config.json"
    return llava_from_config(json.loads(cfg_path.read_text(encoding="utf-8")), cfg_path)


def load_llava_dir(model_dir: Path) -> LlavaWeights:
    arch = read_llava_arch(model_dir)
    raw: dict[str, torch.Tensor] = {}
    for f in safetensors_files(model_dir):
        for name, t in load_file(f, device="cpu").items():
            if not name.endswith("rotary_emb.inv_freq"):
                raw[name] = t.to(torch.float32).contiguous()
    text, vision, projector = split_llava_tensors(raw)
    if arch.text.tie_word_embeddings:
        text.pop("lm_head.weight", None)
    check_tensors(arch.text, text, model_dir)
    return LlavaWeights(arch, LoadedWeights(arch=arch.text, tensors=text, source=model_dir), vision, projector)
