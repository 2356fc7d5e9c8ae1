"""proto/worker.proto's Generate <-> services/engine/request.py: the engine's request and
outputs cross the processor -> decode worker hop unchanged in meaning."""

from __future__ import annotations

from collections.abc import Sequence

from services.codec.multimodal import image_from_pb, image_to_pb
from services.codec.request import (
    finish_from_pb,
    finish_to_pb,
    request_sampling_from_pb,
    sampling_to_pb,
)
from services.engine.multimodal.image_input import PromptImage
from services.engine.request import GenerateRequest, SamplingParams, TokenOutput
from services.gen import multimodal_pb2, worker_pb2


def generate_request_to_pb(request_id: str, token_ids: Sequence[int], sampling: SamplingParams,
                           images: Sequence[PromptImage] = ()) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(
        request_id=request_id, token_ids=token_ids, sampling=sampling_to_pb(sampling),
        images=[multimodal_pb2.PromptImage(offset=x.offset, length=x.length, image=image_to_pb(x.image))
                for x in images])


def prompt_images_from_pb(m: worker_pb2.GenerateRequest) -> tuple[PromptImage, ...]:
    """Raises ValueError for an image whose hash does not match its bytes."""
    return tuple(PromptImage(x.offset, x.length, image_from_pb(x.image)) for x in m.images)


def generate_request_from_pb(m: worker_pb2.GenerateRequest) -> GenerateRequest:
    """Raises ValueError naming a bad field."""
    return GenerateRequest(m.request_id, list(m.token_ids),
                           request_sampling_from_pb(m.request_id, m.sampling))


def output_to_pb(out: TokenOutput, completion_tokens: int) -> worker_pb2.GenerateResponse:
    """``completion_tokens``: tokens of this request streamed so far, this one included."""
    msg = worker_pb2.GenerateResponse(token_ids=out.token_ids)
    if out.finished:
        msg.finish_reason = finish_to_pb(out.finish_reason)
        u = msg.usage
        u.prompt_tokens = out.num_prompt_tokens
        u.completion_tokens = completion_tokens
        u.cached_tokens = out.num_cached_tokens
    return msg


def output_from_pb(request_id: str, m: worker_pb2.GenerateResponse) -> TokenOutput:
    reason = finish_from_pb(m.finish_reason)
    return TokenOutput(request_id, list(m.token_ids), reason is not None, reason,
                       m.usage.prompt_tokens, m.usage.cached_tokens)
