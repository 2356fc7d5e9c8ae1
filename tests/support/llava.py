"""A tiny random LLaVA model on disk and transformers' answer on it (the reference)."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import torch
from PIL import Image

from services.engine.multimodal.image_processor import load_processor_config, preprocess
from services.engine.multimodal.tiny import make_tiny_llava
from services.engine.tokenizer import Tokenizer


def image_png(color: tuple[int, int, int], size: tuple[int, int] = (30, 20)) -> bytes:
    img = Image.new("RGB", size, color)
    img.putpixel((3, 4), (255 - color[0], 0, 255))  # not flat: the crop and resize show
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def make_model(path: Path, vision: str = "clip", text: str = "llama") -> Path:
    return make_tiny_llava(path, vision, text)


def hf_greedy_text(model_dir: Path, text_before: str, pngs: list[bytes], text_after: str,
                   max_new_tokens: int) -> str:
    """transformers' greedy answer to one user message: text_before, the images, text_after."""
    import json

    from transformers import LlavaForConditionalGeneration

    tok = Tokenizer.from_path(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    image_token = tok.id_to_token(cfg["image_token_index"])
    content = text_before + image_token * len(pngs) + text_after
    ids = tok.encode_chat([{"role": "user", "content": content}])
    per_image = cfg["image_seq_length"]
    full: list[int] = []
    for t in ids:
        full.extend([t] * (per_image if t == cfg["image_token_index"] else 1))
    vc = cfg["vision_config"]
    kind = "clip" if vc["model_type"].startswith("clip") else "siglip"
    pp = load_processor_config(model_dir, kind, vc["image_size"])
    pixels = torch.stack([preprocess(Image.open(io.BytesIO(p)), pp) for p in pngs])
    hf = LlavaForConditionalGeneration.from_pretrained(model_dir).float().eval()
    with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor([full]), pixel_values=pixels, max_new_tokens=max_new_tokens,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
    return tok.decode(out[0, len(full):].tolist())
