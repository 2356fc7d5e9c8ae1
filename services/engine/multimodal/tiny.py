"""`tandem model make-tiny-llava DIR`: write a tiny LLaVA checkpoint with RANDOM weights
(config.json, preprocessor_config.json, model.safetensors, a byte-level tokenizer with an
<image> token and a chat template) for demos and tests of the
multimodal path. It produces noise, not answers; it is named so nobody mistakes it."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

NAME = "tandem-tiny-random-llava"


def tiny_llava_config(vision: str, text: str, vocab_size: int, image_size: int, patch_size: int) -> dict:
    vision_type = {"clip": "clip_vision_model", "siglip": "siglip_vision_model"}[vision]
    return {
        "_name_or_path": NAME,
        "architectures": ["LlavaForConditionalGeneration"],
        "model_type": "llava",
        "image_token_index": vocab_size - 1,
        "image_seq_length": (image_size // patch_size) ** 2,
        "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default" if vision == "clip" else "full",
        "projector_hidden_act": "gelu",
        "multimodal_projector_bias": True,
        "tie_word_embeddings": False,
        "text_config": {
            "model_type": text, "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
        },
        "vision_config": {
            "model_type": vision_type, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "image_size": image_size, "patch_size": patch_size, "num_channels": 3,
            "hidden_act": "quick_gelu" if vision == "clip" else "gelu_pytorch_tanh",
            "layer_norm_eps": 1e-5 if vision == "clip" else 1e-6,
            **({} if vision == "clip" else {"vision_use_head": False}),
        },
    }


def random_tensors(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    """Every tensor transformers' LlavaForConditionalGeneration saves, in its checkpoint names."""
    from services.engine.multimodal.vision_tower import ImageEncoder
    from services.engine.weights.layout import expected_shapes
    from services.model.llava_config import llava_from_config

    g = torch.Generator().manual_seed(seed)
    arch = llava_from_config(cfg, Path("config.json"))
    out: dict[str, torch.Tensor] = {}
    for name, shape in expected_shapes(arch.text).items():
        norm = name.endswith("norm.weight")
        t = torch.ones(shape) if norm else torch.randn(shape, generator=g) * 0.1
        out["language_model." + name] = t
    full_arch = llava_from_config({**cfg, "vision_feature_layer": -1}, Path("config.json"))
    for name, t in ImageEncoder(full_arch).state_dict().items():
        norm = "norm" in name and name.endswith("weight")
        out[name] = torch.ones_like(t) if norm else torch.randn(t.shape, generator=g) * 0.1
    # Unused by LLaVA (it reads hidden states before it), written so transformers loads the
    # tower without initialising anything.
    d = arch.vision.hidden_size
    out["vision_tower.post_layernorm.weight"], out["vision_tower.post_layernorm.bias"] = torch.ones(d), torch.zeros(d)
    return out


CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def write_tokenizer(path: Path) -> int:
    """A byte-level tokenizer (one token per byte, no merges) with <unk>, <s>, </s> and the
    <image> token, plus a plain chat template. Returns its vocabulary size; <image> is last."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):  # sorted: the same ids every time
        vocab[ch] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(["<unk>", "<s>", "</s>", "<image>"])
    tk.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "chat_template": CHAT_TEMPLATE,
    }, indent=2), encoding="utf-8")
    return tk.get_vocab_size(with_added_tokens=True)


def make_tiny_llava(path: Path, vision: str = "clip", text: str = "llama",
                    image_size: int = 56, patch_size: int = 14, seed: int = 0) -> Path:
    """Write the model; its vocabulary is the tokenizer's, the image token its last id."""
    path.mkdir(parents=True, exist_ok=True)
    vocab_size = write_tokenizer(path)
    cfg = tiny_llava_config(vision, text, vocab_size, image_size, patch_size)
    (path / "config.json").write_text(json.dumps(cfg, indent=2), encoding="utf-8")
    if vision == "clip":
        pre = {"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": image_size},
               "crop_size": {"height": image_size, "width": image_size}, "do_center_crop": True}
    else:
        pre = {"image_processor_type": "SiglipImageProcessor", "size": {"height": image_size, "width": image_size},
               "image_mean": [0.5] * 3, "image_std": [0.5] * 3}
    (path / "preprocessor_config.json").write_text(json.dumps(pre, indent=2), encoding="utf-8")
    save_file(random_tensors(cfg, seed), str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "README.txt").write_text(f"{NAME}: RANDOM weights, for tests and demos only.\n", encoding="utf-8")
    return path


def main(args: argparse.Namespace) -> int:
    try:
        path = make_tiny_llava(Path(args.dir), args.vision, args.text)
    except (OSError, ValueError) as e:
        print(f"tandem model make-tiny-llava: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0
