"""What the streaming stages ask of the decode workers: ``DecodeWorkerClient`` over gRPC
in a deployment, a scripted fake in unit tests."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Protocol

from services.api.images import PromptImage
from services.api.outputs import TokenOutput
from services.api.sampling import SamplingParams
from services.processor.stages.prompt import Prompt


class WorkerLike(Protocol):
    def generate(self, address: str, request_id: str, token_ids: Sequence[int],
                 sampling: SamplingParams, images: tuple[PromptImage, ...] = ()) -> AsyncIterator[TokenOutput]: ...


def worker_stream(workers: WorkerLike, address: str, request_id: str, prompt: Prompt,
                  ids: list[int], sampling: SamplingParams) -> AsyncIterator[TokenOutput]:
    """The worker's stream for ``ids`` (``prompt.ids`` or, migrating, those and the tokens
    produced); ``prompt.images`` only where there are some, so a text-only fake needs no
    ``images`` parameter."""
    if prompt.images:
        return workers.generate(address, request_id, ids, sampling, images=prompt.images)
    return workers.generate(address, request_id, ids, sampling)
