"""The request the processor sends a decode worker (proto/worker.proto's GenerateRequest;
codec: worker_codec.py). The worker turns it into the engine's own GenerateRequest, which
adds what only the engine holds (image embeddings, the KV to export)."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.api.images import PromptImage
from services.api.move import MoveSource
from services.api.sampling import SamplingParams


@dataclass(frozen=True, slots=True)
class WorkerRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # A multimodal prompt's images, at their placeholder positions (checked against their
    # content hashes by the codec).
    images: tuple[PromptImage, ...] = ()
    # A request moved off a draining worker: prompt_token_ids and sampling are a replay's,
    # and the KV of all but the last token is pulled from here (services/decode/move_in.py).
    move_from: MoveSource | None = None
