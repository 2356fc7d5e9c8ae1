"""What the streaming stages ask of the decode workers: ``DecodeWorkerClient`` over gRPC
in a deployment, a scripted fake in unit tests."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Protocol

from services.api.images import PromptImage
from services.api.move import MoveSource
from services.api.outputs import TokenOutput
from services.api.sampling import SamplingParams
from services.processor.stages.prompt import Prompt


class WorkerLike(Protocol):
    def generate(self, address: str, request_id: str, token_ids: Sequence[int],
                 sampling: SamplingParams, images: tuple[PromptImage, ...] = (),
                 move_from: MoveSource | None = None) -> AsyncIterator[TokenOutput]: ...


def worker_stream(workers: WorkerLike, address: str, request_id: str, prompt: Prompt,
                  ids: list[int], sampling: SamplingParams, move_from: MoveSource | None = None
                  ) -> AsyncIterator[TokenOutput]:
    """The worker's stream for ``ids`` (``prompt.ids`` or, migrating, those and the tokens
    produced; ``move_from``: where a moved request's KV waits); ``prompt.images`` and
    ``move_from`` only where there are some, so a text-only fake needs neither parameter."""
    extra: dict[str, object] = {}
    if prompt.images:
        extra["images"] = prompt.images
    if move_from is not None:
        extra["move_from"] = move_from
    return workers.generate(address, request_id, ids, sampling, **extra)
