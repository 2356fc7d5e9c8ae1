"""Where a request's images sit in its prompt, and their embeddings once encoded (torch-free
except for the tensor it carries)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class ImageSpan:
    """``length`` placeholder tokens at prompt positions ``offset .. offset + length - 1``
    stand for one image; ``embeds`` (length, hidden) replaces their token embeddings in the
    forward. ``content_hash`` (hex sha256 of the image bytes) identifies the image for the
    prefix cache and the embedding cache."""

    offset: int
    length: int
    content_hash: str
    embeds: torch.Tensor | None = None

    @property
    def end(self) -> int:
        return self.offset + self.length

    def with_embeds(self, embeds: Any) -> ImageSpan:
        if tuple(embeds.shape[:1]) != (self.length,):
            raise ValueError(f"image at {self.offset}: {embeds.shape[0]} embedding rows for {self.length} placeholders")
        return ImageSpan(self.offset, self.length, self.content_hash, embeds)


def expand_placeholders(
    token_ids: list[int], image_token_id: int, tokens_per_image: int, content_hashes: list[str]
) -> tuple[list[int], list[ImageSpan]]:
    """Each single ``image_token_id`` in ``token_ids`` becomes ``tokens_per_image`` copies
    (as LLaVA's processor does); returns the expanded prompt and one span per image, in
    order. Raises ValueError when the prompt's image tokens and the images do not pair up."""
    count = token_ids.count(image_token_id)
    if count != len(content_hashes):
        raise ValueError(f"the prompt has {count} image placeholders for {len(content_hashes)} images")
    out: list[int] = []
    spans: list[ImageSpan] = []
    for tok in token_ids:
        if tok == image_token_id:
            spans.append(ImageSpan(len(out), tokens_per_image, content_hashes[len(spans)]))
            out.extend([image_token_id] * tokens_per_image)
        else:
            out.append(tok)
    return out, spans


def check_spans(spans: tuple[ImageSpan, ...], prompt_len: int) -> None:
    """ValueError unless the spans are in order, apart, inside the prompt and encoded."""
    end = 0
    for i, sp in enumerate(spans):
        if sp.length <= 0 or sp.offset < end or sp.end > prompt_len:
            raise ValueError(f"image {i} at {sp.offset}+{sp.length} is outside the prompt "
                             f"({prompt_len} tokens) or overlaps the previous image")
        if sp.embeds is None or tuple(sp.embeds.shape[:1]) != (sp.length,):
            raise ValueError(f"image {i} has no embeddings for its {sp.length} placeholders")
        end = sp.end
