"""How a multimodal model's prompt holds images: the processor puts the model's image token
where each image sits in a chat message, tokenizes, then widens each image token into the
placeholders the vision tower's embeddings fill (``tokens_per_image``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from services.api.images import PromptImage
from services.api.processor import ChatMessage
from services.model.image_spans import expand_placeholders


@dataclass(frozen=True, slots=True)
class ImagePrompting:
    image_token: str  # the token's text, as the chat template and tokenizer see it
    image_token_id: int
    tokens_per_image: int

    @classmethod
    def for_model(cls, model_path: Path | None, token_text) -> ImagePrompting | None:
        """None for a text-only model. ``token_text``: the tokenizer's id -> token text."""
        if model_path is None or not model_path.is_dir():
            return None
        from services.model.llava_config import is_llava_config, llava_from_config

        cfg_path = model_path / "config.json"
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
        if not is_llava_config(cfg):
            return None
        arch = llava_from_config(cfg, cfg_path)
        text = token_text(arch.image_token_id)
        if text is None:
            raise ValueError(f"{model_path}: the tokenizer has no token {arch.image_token_id} (image_token_index)")
        return cls(text, arch.image_token_id, arch.tokens_per_image)

    def render_content(self, message: ChatMessage) -> str:
        """The message's text with the image token before each image's character offset."""
        out, at = [], 0
        for im in message.images:
            out.append(message.content[at : im.char_offset])
            out.append(self.image_token)
            at = im.char_offset
        out.append(message.content[at:])
        return "".join(out)

    def expand(self, ids: list[int], messages: Sequence[ChatMessage]) -> tuple[list[int], tuple[PromptImage, ...]]:
        """Widen the image tokens; ValueError when their count is not the images' (a
        message's text spelling the image token itself)."""
        images = [im.image for m in messages for im in m.images]
        full, spans = expand_placeholders(ids, self.image_token_id, self.tokens_per_image,
                                          [im.content_hash for im in images])
        return full, tuple(PromptImage(s.offset, s.length, im) for s, im in zip(spans, images, strict=True))
