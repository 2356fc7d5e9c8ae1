"""Tiny random LLaVA models (CLIP or SigLIP tower, Llama or Qwen2 text) built with transformers."""

from __future__ import annotations

from pathlib import Path

import torch

IMAGE_TOKEN = 127
VOCAB = 128


def tiny_llava_config(vision: str = "clip", text: str = "llama", feature_layer=-2, strategy: str = "default",
                      image_size: int = 56, patch_size: int = 14):
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        Qwen2Config,
        SiglipVisionConfig,
    )

    vcommon = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                   image_size=image_size, patch_size=patch_size)
    vc = CLIPVisionConfig(**vcommon, projection_dim=16) if vision == "clip" else SiglipVisionConfig(**vcommon)
    tcommon = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
                   initializer_range=0.15)
    tc = LlamaConfig(**tcommon) if text == "llama" else Qwen2Config(**tcommon)
    return LlavaConfig(vision_config=vc, text_config=tc, image_token_index=IMAGE_TOKEN,
                       vision_feature_layer=feature_layer, vision_feature_select_strategy=strategy,
                       image_seq_length=(image_size // patch_size) ** 2)


def tiny_llava(vision: str = "clip", text: str = "llama", feature_layer=-2, strategy: str = "default",
               seed: int = 0, **kw):
    """A random float32 LlavaForConditionalGeneration in eval mode."""
    from transformers import LlavaForConditionalGeneration

    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(tiny_llava_config(vision, text, feature_layer, strategy, **kw)).float().eval()
    with torch.no_grad():
        # Default init leaves biases and norms at 0/1 and small weights: make every part
        # matter so a wrong wiring moves the logits past the tolerance.
        for name, p in model.named_parameters():
            if "language_model" in name and "layers" in name and "proj.weight" in name:
                continue  # keep the text init (initializer_range) so attention stays sane
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
            elif "vision_tower" in name or "multi_modal_projector" in name:
                p.normal_(0, 0.2)
    return model


def save_tiny_llava(model, path: Path) -> Path:
    model.save_pretrained(path)
    return path


def image_prompt(n_text: int, n_images: int, seed: int, tokens_per_image: int) -> tuple[list[int], list[int]]:
    """(single-placeholder prompt, expanded prompt): text tokens with ``n_images`` image
    tokens spread through it."""
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(0, IMAGE_TOKEN, (n_text,), generator=g).tolist()
    short: list[int] = []
    step = max(1, n_text // (n_images + 1))
    for i, tok in enumerate(text):
        if i and i % step == 0 and short.count(IMAGE_TOKEN) < n_images:
            short.append(IMAGE_TOKEN)
        short.append(tok)
    while short.count(IMAGE_TOKEN) < n_images:
        short.append(IMAGE_TOKEN)
    full: list[int] = []
    for tok in short:
        full.extend([tok] * (tokens_per_image if tok == IMAGE_TOKEN else 1))
    return short, full
