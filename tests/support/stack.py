"""Wiring for processor/frontend tests: the real decode worker (services/decode) over a real
engine (mock runner unless given one) on real gRPC, plus the processor, in-process."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import grpc

from services.api.images import PromptImage
from services.api.move import MoveSource
from services.api.outputs import TokenOutput
from services.api.processor import ChatMessage, ProcessRequest
from services.api.route import RequestPhase, RouteRequest, RouteResponse
from services.api.sampling import SamplingParams
from services.common.address_book import ChannelPool
from services.common.config import ClusterConfig
from services.decode.grpc_server import serve_decode_worker
from services.decode.worker import DecodeWorker
from services.engine.async_engine import AsyncEngine
from services.engine.engine import LLMEngine
from services.engine.request import GenerateRequest
from services.engine.runner.mock_runner import MockRunner
from services.model.tokenizer import Tokenizer
from services.processor.processor import Processor
from services.processor.router_reports import Publish, RouterLike
from services.processor.worker_client import DecodeWorkerClient
from services.router.router import Router
from tests.support.mock_cluster import MODEL


class RecordingDecodeWorker(DecodeWorker):
    """The real DecodeWorker, keeping the request id of every ``generate`` call it got, in
    arrival order (a call it then refuses, e.g. over its admission limits, included)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.generate_calls: list[str] = []

    async def generate(self, request: GenerateRequest, images: tuple[PromptImage, ...] = (),
                       move_from: MoveSource | None = None) -> AsyncIterator[TokenOutput]:
        self.generate_calls.append(request.request_id)
        async with aclosing(super().generate(request, images, move_from)) as outs:
            async for o in outs:
                yield o


@dataclass
class DecodeNode:
    engine: AsyncEngine
    server: grpc.aio.Server
    port: int
    worker: RecordingDecodeWorker

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@asynccontextmanager
async def worker_decode_node(cfg: ClusterConfig, tok: Tokenizer | None = None,
                             worker_id: str = "w0", engine: LLMEngine | None = None,
                             has_peers: Callable[[], Awaitable[bool]] | None = None
                             ) -> AsyncIterator[DecodeNode]:
    """The real decode worker (services/decode: admission limits, drain, RESOURCE_EXHAUSTED)
    over ``engine`` (default: the mock runner's, from ``cfg``), local prefill only, served by
    its own ``serve_decode_worker`` on real gRPC over TCP."""
    if engine is None:
        stops = tok.stop_token_ids if tok is not None else (cfg.engine.mock.eos_token_id,)
        engine = LLMEngine(MockRunner(cfg.engine), cfg.engine, stops, worker_id=worker_id)
    async with AsyncEngine(engine) as ae:
        worker = RecordingDecodeWorker(ae, cfg, worker_id, has_peers=has_peers)
        server, port = await serve_decode_worker(worker, "127.0.0.1", 0)
        worker.kv_address = f"127.0.0.1:{port}"
        try:
            yield DecodeNode(ae, server, port, worker)
        finally:
            await server.stop(grace=0)
            await worker.close()


def make_processor(cfg: ClusterConfig, tok: Tokenizer, router: RouterLike, context_length: int,
                   pool: ChannelPool, publish_reports: Publish | None = None) -> Processor:
    return Processor(tok, router, DecodeWorkerClient(pool), MODEL, context_length,
                     cfg.engine.block_size, publish_reports=publish_reports)


def chat(rid: str, **sampling: Any) -> ProcessRequest:
    """A one-message chat request for the mock cluster's model."""
    return ProcessRequest(rid, messages=(ChatMessage("user", "Tell me a story"),), model=MODEL,
                          sampling=SamplingParams(**sampling))


class RecordingRouter(Router):
    """The real in-process Router, keeping every (request, response) it routed and every
    (request id, phase) update it applied; ``fail_updates_for``: request ids whose updates
    raise, as an unreachable router's would."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.routed: list[tuple[RouteRequest, RouteResponse]] = []
        self.updates: list[tuple[str, RequestPhase]] = []
        self.fail_updates_for: set[str] = set()

    async def route(self, req: RouteRequest) -> RouteResponse:
        r = await super().route(req)
        self.routed.append((req, r))
        return r

    async def update(self, request_id: str, phase: RequestPhase) -> None:
        if request_id in self.fail_updates_for:
            raise RuntimeError("router unreachable")
        await super().update(request_id, phase)
        self.updates.append((request_id, phase))
