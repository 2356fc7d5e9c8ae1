"""Our image preprocessing equals transformers' (PIL backend) for CLIP and SigLIP configs."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from services.engine.multimodal.image_processor import ImageProcessorConfig, preprocess


@pytest.mark.parametrize("shape", [(50, 73), (90, 31), (28, 28)])
@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_matches_transformers(kind, shape):
    from transformers import CLIPImageProcessor, SiglipImageProcessor

    img = Image.fromarray(np.random.default_rng(0).integers(0, 255, (*shape, 3), dtype=np.uint8))
    if kind == "clip":
        hp = CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    else:
        hp = SiglipImageProcessor(size={"height": 28, "width": 28})
    want = hp(images=img, return_tensors="pt")["pixel_values"][0]
    got = preprocess(img, ImageProcessorConfig.from_dict(hp.to_dict(), 28))
    assert got.shape == (3, 28, 28)
    assert (got - want).abs().max().item() < 1e-5


def test_default_config_when_the_file_is_missing():
    cfg = ImageProcessorConfig.default_for("siglip", 32)
    px = preprocess(Image.new("RGB", (10, 20), (255, 0, 127)), cfg)
    assert px.shape == (3, 32, 32)
    assert px[0].min().item() == pytest.approx(1.0) and px[1].max().item() == pytest.approx(-1.0)
