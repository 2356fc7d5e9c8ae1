"""The architecture of a LLaVA model (vision tower + projector + Llama/Qwen2 text model),
read from a Hugging Face ``LlavaForConditionalGeneration`` config.json."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.model.arch import ModelArchConfig
from services.model.errors import UnsupportedModelError

VISION_KINDS = {"clip_vision_model": "clip", "siglip_vision_model": "siglip"}

# transformers' config defaults: a checkpoint's config.json (llava-hf/llava-1.5-7b-hf's
# text_config, for one) leaves out every key at its default.
_TEXT_DEFAULTS = {
    "llama": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
              "num_attention_heads": 32, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6},
    "qwen2": {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 32768,
              "rms_norm_eps": 1e-6},
}
_VISION_DEFAULTS = {
    "clip_vision_model": {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                          "num_attention_heads": 12, "image_size": 224, "patch_size": 32},
    "siglip_vision_model": {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                            "num_attention_heads": 12, "image_size": 224, "patch_size": 16},
}
SELECT_STRATEGIES = ("default", "full")  # default drops the CLS token (the first patch row)
ACTIVATIONS = ("gelu", "quick_gelu", "gelu_pytorch_tanh", "gelu_new")


@dataclass(frozen=True, slots=True)
class VisionTowerConfig:
    kind: str  # "clip" | "siglip"
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-5
    hidden_act: str = "quick_gelu"

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"vision hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}")
        if self.image_size % self.patch_size:
            raise ValueError(f"vision image_size {self.image_size} is not a multiple of patch_size {self.patch_size}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"vision hidden_act {self.hidden_act!r} is not supported ({', '.join(ACTIVATIONS)})")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def has_cls(self) -> bool:
        return self.kind == "clip"

    @property
    def num_positions(self) -> int:
        """Rows the tower's hidden states have per image (patches, plus CLIP's CLS token)."""
        return self.num_patches + (1 if self.has_cls else 0)


@dataclass(frozen=True, slots=True)
class LlavaArchConfig:
    text: ModelArchConfig
    vision: VisionTowerConfig
    image_token_id: int
    feature_layers: tuple[int, ...]  # indices into the tower's hidden states (0 = embeddings)
    select_strategy: str = "default"
    projector_act: str = "gelu"
    projector_bias: bool = True

    def __post_init__(self) -> None:
        if self.select_strategy not in SELECT_STRATEGIES:
            raise ValueError(f"vision_feature_select_strategy {self.select_strategy!r} is not supported")
        if self.projector_act not in ACTIVATIONS:
            raise ValueError(f"projector_hidden_act {self.projector_act!r} is not supported")
        n = self.vision.num_layers
        for layer in self.feature_layers:
            if not -(n + 1) <= layer <= n:
                raise ValueError(f"vision_feature_layer {layer} is outside the tower's {n + 1} hidden states")
        if not 0 <= self.image_token_id < self.text.vocab_size:
            raise ValueError(f"image_token_index {self.image_token_id} is outside the vocabulary")

    @property
    def tokens_per_image(self) -> int:
        """Placeholder tokens (and embedding rows) one image takes in the prompt."""
        drop = 1 if self.select_strategy == "default" else 0
        return self.vision.num_positions - drop

    @property
    def feature_indices(self) -> tuple[int, ...]:
        """``feature_layers`` as non-negative indices into the full tower's hidden states."""
        n = self.vision.num_layers
        return tuple(layer if layer >= 0 else n + 1 + layer for layer in self.feature_layers)

    @property
    def layers_to_run(self) -> int:
        """Encoder layers the tower must run to produce every selected hidden state."""
        return max(self.feature_indices)


def is_llava_config(cfg: dict[str, Any]) -> bool:
    return (cfg.get("architectures") or [None])[0] == "LlavaForConditionalGeneration"


def vision_from_config(cfg: dict[str, Any], where: Path) -> VisionTowerConfig:
    cfg = {**_VISION_DEFAULTS.get(cfg.get("model_type", "clip_vision_model"), {}), **cfg}
    kind = VISION_KINDS.get(cfg.get("model_type", "clip_vision_model"))
    if kind is None:
        raise UnsupportedModelError(
            f"{where}: vision tower {cfg.get('model_type')!r} is not supported ({', '.join(VISION_KINDS)})"
        )
    try:
        return VisionTowerConfig(
            kind=kind,
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=int(cfg["num_attention_heads"]),
            image_size=int(cfg["image_size"]),
            patch_size=int(cfg["patch_size"]),
            num_channels=int(cfg.get("num_channels", 3)),
            layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-5 if kind == "clip" else 1e-6)),
            hidden_act=str(cfg.get("hidden_act", "quick_gelu" if kind == "clip" else "gelu_pytorch_tanh")),
        )
    except (KeyError, ValueError) as e:
        raise UnsupportedModelError(f"{where}: vision_config: {e}") from e


def llava_from_config(cfg: dict[str, Any], where: Path) -> LlavaArchConfig:
    """Build LlavaArchConfig from a LlavaForConditionalGeneration config.json dict."""
    from services.model.hf_config import arch_from_config

    text_cfg = dict(cfg.get("text_config") or {})
    text_type = text_cfg.get("model_type", "llama")
    text_cfg = {**_TEXT_DEFAULTS.get(text_type, {}), **text_cfg}
    text_cfg["architectures"] = [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}.get(text_type, text_type)]
    text_cfg.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
    text = arch_from_config(text_cfg, where)
    vision = vision_from_config(cfg.get("vision_config") or {}, where)
    layers = cfg.get("vision_feature_layer", -2)
    feature_layers = (int(layers),) if isinstance(layers, int) else tuple(int(x) for x in layers)
    image_token = cfg.get("image_token_index", cfg.get("image_token_id"))
    if image_token is None:
        raise UnsupportedModelError(f"{where}: image_token_index is missing")
    try:
        return LlavaArchConfig(
            text=text,
            vision=vision,
            image_token_id=int(image_token),
            feature_layers=feature_layers,
            select_strategy=str(cfg.get("vision_feature_select_strategy", "default")),
            projector_act=str(cfg.get("projector_hidden_act", "gelu")),
            projector_bias=bool(cfg.get("multimodal_projector_bias", True)),
        )
    except ValueError as e:
        raise UnsupportedModelError(f"{where}: {e}") from e
