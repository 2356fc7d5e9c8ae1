"""What enters the engine: a request's prompt, sampling and, on the prefill side of
disaggregation, which KV to export. Sampling and outputs are the cluster's types
(services/api)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from services.api.sampling import SamplingParams
from services.common.hashing import BlockHash

if TYPE_CHECKING:
    from services.model.image_spans import ImageSpan


@dataclass(slots=True)
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # Prefill side of disaggregation: when set, the KV of prompt blocks
    # [export_kv_from_block, ceil(prompt_len / block_size)) is exported when the request
    # finishes (before its blocks are freed) and attached to the final TokenOutput.kv.
    export_kv_from_block: int | None = None
    # A multimodal prompt's images: their placeholder positions, content hashes (part of
    # the prefix-cache block hashes) and embeddings (set before the request is added).
    images: tuple[ImageSpan, ...] = ()
    # The prompt's full-block hashes when the caller computed them already (it hashed the
    # prompt to route it): ``block_hashes(prompt_token_ids, engine.block_size)``, images
    # included, one per full block. The engine then hashes only the blocks that fill later.
    block_hashes: Sequence[BlockHash] | None = None
