"""A DecodeWorker gRPC servicer over the real engine, for tests until services/decode lands.

It is the real ``AsyncEngine`` over the real ``LLMEngine`` (mock or tiny torch runner) behind
proto/worker.proto's ``Generate``: local prefill only, no KV events, no load metrics. To
switch the tests to the real decode worker, replace ``start_decode_server`` with the decode
part's own ``start_grpc`` (same shape: engine in, (server, port) out).
"""

from __future__ import annotations

from contextlib import aclosing

import grpc

from services.engine.async_engine import AsyncEngine, EngineDeadError
from services.engine.request import FinishReason, GenerateRequest, SamplingParams
from services.engine.scheduler import InvalidRequestError
from services.gen import worker_pb2, worker_pb2_grpc

_FINISH = {FinishReason.STOP: worker_pb2.STOP, FinishReason.LENGTH: worker_pb2.LENGTH,
           FinishReason.ABORT: worker_pb2.ABORT}


class EngineDecodeServicer(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.started: list[str] = []  # request ids, in arrival order

    async def Generate(self, request, context: grpc.aio.ServicerContext):  # noqa: N802
        s = request.sampling
        try:
            sp = SamplingParams(
                temperature=s.temperature, top_k=s.top_k, top_p=s.top_p or 1.0,
                seed=s.seed if s.HasField("seed") else None, max_tokens=s.max_tokens,
                stop_token_ids=tuple(s.stop_token_ids), ignore_eos=s.ignore_eos,
                seed_step_offset=s.seed_step_offset)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        req = GenerateRequest(request.request_id, list(request.token_ids), sp)
        self.started.append(req.request_id)
        n = 0
        try:
            self.engine.validate(req)  # the entry: the engine trusts its callers
            async with aclosing(self.engine.generate(req)) as outs:
                async for out in outs:
                    n += len(out.token_ids)
                    msg = worker_pb2.GenerateResponse(token_ids=out.token_ids)
                    if n == len(out.token_ids):
                        msg.prefill_location = worker_pb2.LOCAL
                    if out.finished:
                        msg.finish_reason = _FINISH[out.finish_reason or FinishReason.STOP]
                        msg.usage.CopyFrom(worker_pb2.Usage(
                            prompt_tokens=out.num_prompt_tokens, completion_tokens=n,
                            cached_tokens=out.num_cached_tokens))
                    yield msg
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
