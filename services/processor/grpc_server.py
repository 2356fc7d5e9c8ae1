"""gRPC adapter for the Processor part (proto/processor.proto); all logic is in Processor.

Typed errors become statuses through services/common/errors.py's table. A cancelled call
(client gone) cancels the handler, which closes the processor's stream and so cancels the
decode worker's call.
"""

from __future__ import annotations

from contextlib import aclosing

import grpc

from services.api.processor_codec import delta_to_pb, models_to_pb, request_from_pb
from services.common.errors import ServingError, abort, decode_or_abort
from services.common.grpc_server import serve_grpc
from services.gen import processor_pb2, processor_pb2_grpc
from services.gen.processor_pb2_grpc import add_ProcessorServicer_to_server
from services.processor.processor import Processor


class ProcessorServicer(processor_pb2_grpc.ProcessorServicer):
    def __init__(self, processor: Processor) -> None:
        self._p = processor

    async def Generate(self, request: processor_pb2.ProcessRequest,  # noqa: N802
                       context: grpc.aio.ServicerContext):
        req = await decode_or_abort(context, request_from_pb, request)
        try:
            async with aclosing(self._p.generate(req)) as deltas:
                async for d in deltas:
                    yield delta_to_pb(d)
        except ServingError as e:
            await abort(context, e)

    async def ListModels(self, request: processor_pb2.ListModelsRequest,  # noqa: N802
                         context: grpc.aio.ServicerContext) -> processor_pb2.ListModelsResponse:
        return models_to_pb(await self._p.list_models())


async def serve_processor(processor: Processor, host: str, port: int
                          ) -> tuple[grpc.aio.Server, int]:
    """Serve ``processor`` on host:port (0 = a free port); returns the server and bound port."""
    return await serve_grpc("processor", host, port, lambda s: add_ProcessorServicer_to_server(
        ProcessorServicer(processor), s))
