"""schemathesis over the frontend's own OpenAPI schema (/openapi.json), in-process: the ASGI
app with the in-process processor and router over the REAL decode worker (mock runner) on
gRPC. Whatever the generated request, the answer is never a 5xx and the app keeps serving.
``frontend.max_tokens_limit`` is small so generated requests stay cheap."""

from __future__ import annotations

from contextlib import asynccontextmanager
from pathlib import Path

import schemathesis
from hypothesis import HealthCheck, settings

from services.common.address_book import ChannelPool
from services.common.discovery import Registration
from services.engine.model_store import resolve_model_path
from services.engine.tokenizer import Tokenizer
from services.frontend.app import create_app
from services.processor.processor import Processor
from services.router.router import Router
from tests.support.stack import MODEL, make_processor, mock_cluster_cfg, worker_decode_node

CFG = mock_cluster_cfg(frontend={"max_tokens_limit": 16, "max_body_bytes": 65536},
                       decode={"max_waiting_requests": 64})


class _Deferred:
    """The processor, built in the app's lifespan (on the loop that serves requests)."""

    target: Processor | None = None

    def generate(self, req):
        assert self.target is not None
        return self.target.generate(req)

    async def list_models(self):
        assert self.target is not None
        return await self.target.list_models()


_proc = _Deferred()
_state: dict = {}


@asynccontextmanager
async def _lifespan(app):
    tok = Tokenizer.from_path(resolve_model_path("auto"))  # the test's fixture skips without it
    pool = ChannelPool()
    async with worker_decode_node(CFG, tok) as node:
        router = Router(CFG)
        router.worker_joined(Registration("decode", "w0", address=node.address))
        _proc.target = make_processor(CFG, tok, router, 128, pool)
        _state["node"] = node
        yield
    await pool.close()


schema = schemathesis.openapi.from_asgi("/openapi.json", create_app(CFG, _proc, lifespan=_lifespan))


@schema.parametrize()
@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_no_request_gets_a_5xx(case, smollm2_path: Path) -> None:
    if isinstance(case.body, dict) and "model" in case.body:
        # NOTE: a random model name is a 404 before anything else; name the served one so
        # generated requests reach the processor and the worker.
        case.body["model"] = MODEL
    response = case.call()
    assert response.status_code < 500, (case.method, case.path, case.body, response.text)
