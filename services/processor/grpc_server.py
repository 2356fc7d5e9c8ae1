"""gRPC adapter for the Processor part (proto/processor.proto); all logic is in Processor.

Typed errors become statuses: InvalidRequest -> INVALID_ARGUMENT, ModelNotFound ->
NOT_FOUND, Unavailable -> UNAVAILABLE, other ProcessorError -> INTERNAL; the error's
``code``/``param`` travel as trailing metadata so the frontend can rebuild it. A cancelled
call (client gone) cancels the handler, which closes the processor's stream and so
cancels the decode worker's call.
"""

from __future__ import annotations

from contextlib import aclosing

import grpc

from services.common.grpc_guard import RejectMalformed
from services.gen import processor_pb2, processor_pb2_grpc
from services.processor.processor import Processor
from services.processor.types import (
    ChatMessage,
    InvalidRequest,
    ModelNotFound,
    Overloaded,
    ProcessorError,
    ProcessRequest,
    SamplingOptions,
    Unavailable,
)

CODE_KEY = "tandem-error-code"
PARAM_KEY = "tandem-error-param"

_STATUS = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    ModelNotFound: grpc.StatusCode.NOT_FOUND,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
}


def request_from_pb(msg: processor_pb2.ProcessRequest) -> ProcessRequest:
    s = msg.sampling
    sampling = SamplingOptions(
        max_tokens=s.max_tokens if s.HasField("max_tokens") else None,
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
        seed=s.seed if s.HasField("seed") else None, stop=tuple(s.stop),
    )
    which = msg.WhichOneof("input")
    return ProcessRequest(
        request_id=msg.request_id, model=msg.model, sampling=sampling,
        messages=tuple(ChatMessage(m.role, m.content) for m in msg.chat.messages)
        if which == "chat" else None,
        prompt=msg.prompt if which == "prompt" else None,
        prompt_ids=tuple(msg.prompt_ids.ids) if which == "prompt_ids" else None,
    )


def request_to_pb(req: ProcessRequest) -> processor_pb2.ProcessRequest:
    s = req.sampling
    sampling = processor_pb2.SamplingOptions(
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, stop=s.stop)
    if s.max_tokens is not None:
        sampling.max_tokens = s.max_tokens
    if s.seed is not None:
        sampling.seed = s.seed
    msg = processor_pb2.ProcessRequest(request_id=req.request_id, model=req.model, sampling=sampling)
    if req.messages is not None:
        msg.chat.messages.extend(processor_pb2.ChatMessage(role=m.role, content=m.content)
                                 for m in req.messages)
    elif req.prompt is not None:
        msg.prompt = req.prompt
    elif req.prompt_ids is not None:
        msg.prompt_ids.ids.extend(req.prompt_ids)
    return msg


class ProcessorServicer(processor_pb2_grpc.ProcessorServicer):
    def __init__(self, processor: Processor) -> None:
        self._p = processor

    async def Generate(self, request, context: grpc.aio.ServicerContext):  # noqa: N802
        try:
            req = request_from_pb(request)
        except ValueError as e:  # e.g. a seed outside the engine's range
            await _abort(context, InvalidRequest(str(e)))
        try:
            async with aclosing(self._p.generate(req)) as deltas:
                async for d in deltas:
                    msg = processor_pb2.ProcessResponse(text=d.text, finish_reason=d.finish_reason or "")
                    if d.usage is not None:
                        msg.usage.CopyFrom(processor_pb2.Usage(
                            prompt_tokens=d.usage.prompt_tokens,
                            completion_tokens=d.usage.completion_tokens,
                            cached_tokens=d.usage.cached_tokens))
                    yield msg
        except ProcessorError as e:
            await _abort(context, e)

    async def ListModels(self, request, context: grpc.aio.ServicerContext):  # noqa: N802
        models = await self._p.list_models()
        return processor_pb2.ListModelsResponse(models=[
            processor_pb2.ModelInfo(id=m.id, context_length=m.context_length) for m in models])


async def _abort(context: grpc.aio.ServicerContext, e: ProcessorError) -> None:
    meta = [(k, v) for k, v in ((CODE_KEY, e.code), (PARAM_KEY, e.param)) if v]
    status = _STATUS.get(type(e), grpc.StatusCode.INTERNAL)
    await context.abort(status, e.message, trailing_metadata=tuple(meta))


async def start_grpc(processor: Processor, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    """Serve ``processor`` on host:port (0 = a free port); returns the server and bound port."""
    server = grpc.aio.server(interceptors=[RejectMalformed()])
    processor_pb2_grpc.add_ProcessorServicer_to_server(ProcessorServicer(processor), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"processor: cannot bind gRPC port {host}:{port}")
    await server.start()
    return server, bound
