"""`tandem model make-tiny-llava` writes a checkpoint transformers and our loader both read,
with the same logits for an image prompt."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from services.cli import main as cli_main
from services.engine.multimodal.image_processor import load_processor_config, preprocess
from services.engine.multimodal.vision_tower import ImageEncoder
from services.engine.multimodal.weights import load_llava_dir
from services.model.image_spans import expand_placeholders
from tests.support.tiny_model import batch, make_runner, seq


@pytest.mark.parametrize("vision,text", [("clip", "llama"), ("siglip", "qwen2")])
def test_written_model_matches_transformers(tmp_path, vision, text):
    from transformers import LlavaForConditionalGeneration

    assert cli_main(["model", "make-tiny-llava", str(tmp_path), "--vision", vision, "--text", text]) == 0
    assert "random" in json.loads((tmp_path / "config.json").read_text())["_name_or_path"]
    w = load_llava_dir(tmp_path)
    encoder = ImageEncoder(w.arch)
    encoder.load_hf_weights(w.vision, w.projector)
    pixels = preprocess(Image.new("RGB", (40, 70), (10, 200, 30)),
                        load_processor_config(tmp_path, w.arch.vision.kind, w.arch.vision.image_size))[None]
    full, spans = expand_placeholders([5, 6, w.arch.image_token_id, 7, 8], w.arch.image_token_id,
                                      w.arch.tokens_per_image, ["h"])
    s = seq("a", full, 0, list(range((len(full) + 3) // 4)))
    s.images = (spans[0].with_embeds(encoder(pixels)[0]),)
    got = make_runner(w.text.arch, w.text.tensors).logits_for(batch(s))

    hf = LlavaForConditionalGeneration.from_pretrained(tmp_path).float().eval()
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([full]), pixel_values=pixels).logits[0, -1:]
    assert (got - want).abs().max().item() < 1e-4


def test_sparse_config_takes_transformers_defaults(tmp_path):
    """llava-hf/llava-1.5-7b-hf's config.json leaves defaults out; we read it as transformers does."""
    from transformers import LlavaConfig

    from services.model.llava_config import llava_from_config

    cfg = {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava", "image_token_index": 32000,
           "vision_config": {"model_type": "clip_vision_model", "hidden_size": 1024, "image_size": 336,
                             "intermediate_size": 4096, "num_attention_heads": 16, "num_hidden_layers": 24,
                             "patch_size": 14, "projection_dim": 768},
           "text_config": {"model_type": "llama", "max_position_embeddings": 4096, "rms_norm_eps": 1e-05,
                           "vocab_size": 32064}}
    ours = llava_from_config(cfg, tmp_path / "config.json")
    hf = LlavaConfig(**{k: v for k, v in cfg.items() if k != "architectures"})
    t = hf.text_config
    assert (ours.text.hidden_size, ours.text.intermediate_size, ours.text.num_layers, ours.text.num_heads,
            ours.text.num_kv_heads, ours.text.vocab_size, ours.text.max_position_embeddings) == (
        t.hidden_size, t.intermediate_size, t.num_hidden_layers, t.num_attention_heads, t.num_key_value_heads,
        t.vocab_size, t.max_position_embeddings)
    assert ours.tokens_per_image == 576 and ours.feature_indices == (23,)
    assert ours.vision.hidden_act == hf.vision_config.hidden_act
