"""proto/worker.proto's Generate <-> WorkerRequest (worker.py) and the TokenOutputs
(outputs.py) a decode worker streams back to the processor."""

from __future__ import annotations

from collections.abc import Sequence

from services.api.images import PromptImage
from services.api.images_codec import image_from_pb, image_to_pb
from services.api.move import MoveSource
from services.api.outputs import TokenOutput
from services.api.request_codec import (
    finish_from_pb,
    finish_to_pb,
    logprob_from_pb,
    logprob_to_pb,
    request_sampling_from_pb,
    sampling_to_pb,
)
from services.api.sampling import SamplingParams
from services.api.worker import WorkerRequest
from services.gen import multimodal_pb2, worker_pb2


def generate_request_to_pb(request_id: str, token_ids: Sequence[int], sampling: SamplingParams,
                           images: Sequence[PromptImage] = (), move_from: MoveSource | None = None
                           ) -> worker_pb2.GenerateRequest:
    m = worker_pb2.GenerateRequest(
        request_id=request_id, token_ids=token_ids, sampling=sampling_to_pb(sampling),
        images=[multimodal_pb2.PromptImage(offset=x.offset, length=x.length, image=image_to_pb(x.image))
                for x in images])
    if move_from is not None:
        m.move_from.CopyFrom(move_source_to_pb(move_from))
    return m


def move_source_to_pb(s: MoveSource) -> worker_pb2.MoveSource:
    return worker_pb2.MoveSource(worker_id=s.worker_id, address=s.address, move_token=s.token)


def move_source_from_pb(m: worker_pb2.MoveSource) -> MoveSource | None:
    """None for the empty MoveSource (a request handed back with nothing kept)."""
    return MoveSource(m.worker_id, m.address, m.move_token) if m.address else None


def generate_request_from_pb(m: worker_pb2.GenerateRequest) -> WorkerRequest:
    """Raises ValueError naming a bad field (an image whose hash does not match its bytes,
    too)."""
    sampling = request_sampling_from_pb(m.request_id, m.sampling)
    images = tuple(PromptImage(x.offset, x.length, image_from_pb(x.image)) for x in m.images)
    move_from = move_source_from_pb(m.move_from) if m.HasField("move_from") else None
    if move_from is not None and (len(m.token_ids) < 2 or sampling.seed_step_offset < 1):
        raise ValueError("move_from: a moved request carries at least one produced token "
                         "(token_ids and sampling.seed_step_offset)")
    return WorkerRequest(m.request_id, list(m.token_ids), sampling, images, move_from)


def output_to_pb(out: TokenOutput, completion_tokens: int) -> worker_pb2.GenerateResponse:
    """``completion_tokens``: tokens of this request streamed so far, this one included."""
    msg = worker_pb2.GenerateResponse(token_ids=out.token_ids, index=out.index)
    if out.logprobs is not None:
        msg.logprobs.extend(logprob_to_pb(lp) for lp in out.logprobs)
    if out.prompt_logprobs is not None:
        msg.prompt_logprobs.extend(logprob_to_pb(lp) for lp in out.prompt_logprobs)
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
                       m.usage.prompt_tokens, m.usage.cached_tokens,
                       logprobs=[logprob_from_pb(x) for x in m.logprobs] if m.logprobs else None,
                       index=m.index,
                       prompt_logprobs=([logprob_from_pb(x) for x in m.prompt_logprobs]
                                        if m.prompt_logprobs else None))
