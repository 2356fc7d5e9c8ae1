"""A DecodeWorker gRPC servicer over the real engine, for tests until services/decode lands.

It is the real ``AsyncEngine`` over the real ``LLMEngine`` (mock or tiny torch runner) behind
proto/worker.proto's ``Generate``: local prefill only, no KV events, no load metrics. To
switch the tests to the real decode worker, replace ``start_decode_server`` with the decode
part's own ``start_grpc`` (same shape: engine in, (server, port) out).
"""

from __future__ import annotations

from contextlib import aclosing

import grpc

from services.codec.worker import generate_request_from_pb, output_to_pb
from services.engine.async_engine import AsyncEngine, EngineDeadError
from services.engine.scheduler import InvalidRequestError
from services.gen import worker_pb2_grpc


class EngineDecodeServicer(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.started: list[str] = []  # request ids, in arrival order

    async def Generate(self, request, context: grpc.aio.ServicerContext):  # noqa: N802
        try:
            req = generate_request_from_pb(request)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        self.started.append(req.request_id)
        n = 0
        try:
            async with aclosing(self.engine.generate(req)) as outs:
                async for out in outs:
                    n += len(out.token_ids)
                    yield output_to_pb(out, n)
        except InvalidRequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except EngineDeadError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))


async def start_decode_server(engine: AsyncEngine, host: str = "127.0.0.1",
                              port: int = 0) -> tuple[grpc.aio.Server, int, EngineDecodeServicer]:
    server = grpc.aio.server()
    servicer = EngineDecodeServicer(engine)
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    return server, bound, servicer
