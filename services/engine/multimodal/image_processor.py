"""Image -> normalised pixels, as the model's ``preprocessor_config.json`` says (CLIP's
shortest-edge resize + centre crop, or SigLIP's fixed-size resize; rescale; normalise)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from services.model.errors import UnsupportedModelError

_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True, slots=True)
class ImageProcessorConfig:
    shortest_edge: int | None  # resize so the short side is this (aspect kept) ...
    size: tuple[int, int] | None  # ... or to exactly (height, width)
    crop: tuple[int, int] | None  # centre crop (height, width) after the resize
    resample: int = 3  # PIL resampling filter (3 = bicubic)
    rescale_factor: float = 1 / 255
    mean: tuple[float, float, float] = _CLIP_MEAN
    std: tuple[float, float, float] = _CLIP_STD
    do_normalize: bool = True

    @classmethod
    def from_dict(cls, d: dict[str, Any], image_size: int) -> ImageProcessorConfig:
        size = d.get("size") or {}
        crop = d.get("crop_size") or {}
        do_resize = d.get("do_resize", True)
        if isinstance(size, int):
            size = {"shortest_edge": size}
        if isinstance(crop, int):
            crop = {"height": crop, "width": crop}
        return cls(
            shortest_edge=int(size["shortest_edge"]) if do_resize and "shortest_edge" in size else None,
            size=(int(size["height"]), int(size["width"])) if do_resize and "height" in size else None,
            crop=(int(crop["height"]), int(crop["width"])) if d.get("do_center_crop") and crop else None,
            resample=int(d.get("resample", 3)),
            rescale_factor=float(d.get("rescale_factor", 1 / 255)) if d.get("do_rescale", True) else 1.0,
            mean=tuple(d.get("image_mean", _CLIP_MEAN)),
            std=tuple(d.get("image_std", _CLIP_STD)),
            do_normalize=bool(d.get("do_normalize", True)),
        )

    @classmethod
    def default_for(cls, kind: str, image_size: int) -> ImageProcessorConfig:
        """What transformers' CLIP / SigLIP image processors do at this tower's size."""
        if kind == "clip":
            return cls(shortest_edge=image_size, size=None, crop=(image_size, image_size))
        return cls(shortest_edge=None, size=(image_size, image_size), crop=None, mean=(0.5,) * 3, std=(0.5,) * 3)


def load_processor_config(model_dir: Path, kind: str, image_size: int) -> ImageProcessorConfig:
    path = model_dir / "preprocessor_config.json"
    if not path.is_file():
        return ImageProcessorConfig.default_for(kind, image_size)
    try:
        return ImageProcessorConfig.from_dict(json.loads(path.read_text(encoding="utf-8")), image_size)
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise UnsupportedModelError(f"{path}: {e}") from e


def preprocess(image: Image.Image, cfg: ImageProcessorConfig) -> torch.Tensor:
    """A PIL image -> float32 pixels (3, H, W)."""
    img = image.convert("RGB")
    if cfg.shortest_edge is not None:
        w, h = img.size
        short, long = (w, h) if w <= h else (h, w)
        new_long = int(cfg.shortest_edge * long / short)
        new = (cfg.shortest_edge, new_long) if w <= h else (new_long, cfg.shortest_edge)
        img = img.resize(new, resample=cfg.resample)
    elif cfg.size is not None:
        img = img.resize((cfg.size[1], cfg.size[0]), resample=cfg.resample)
    arr = np.asarray(img, dtype=np.float32)  # (H, W, 3)
    if cfg.crop is not None:
        ch, cw = cfg.crop
        h, w = arr.shape[:2]
        top, left = max(0, (h - ch) // 2), max(0, (w - cw) // 2)
        arr = arr[top : top + ch, left : left + cw]
    arr = arr * cfg.rescale_factor
    if cfg.do_normalize:
        arr = (arr - np.asarray(cfg.mean, dtype=np.float32)) / np.asarray(cfg.std, dtype=np.float32)
    return torch.from_numpy(np.ascontiguousarray(arr.transpose(2, 0, 1)))
