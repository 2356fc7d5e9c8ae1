"""The OpenAI-compatible HTTP API: ``create_app(cfg, processor, readiness)``.

``processor`` is the in-process ``Processor`` or a ``ProcessorClient`` (same ``generate`` /
``list_models``). Streaming answers are SSE ending in ``data: [DONE]``. The first delta is
awaited before the response starts so that errors found before generation (bad input,
prompt too long, no workers) get their HTTP status even for ``stream: true``.

The HTTP edge (docs/api.md, "Errors"): the body is read under a size limit and a deadline
and parsed with bounded depth (``body.py``), validated strictly (``schemas.py``,
``validation.py``); every error, an unexpected exception included (``guard.py``), is
answered in OpenAI's shape, and 429/503/500 never name the cluster's insides (``errors.py``).

Cancellation: a client that disconnects mid-stream cancels the SSE generator; it closes the
processor stream, which cancels the gRPC call to the processor, which cancels its call to
the decode worker, which aborts the request in the engine.
"""

from __future__ import annotations

import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from services.api.processor import Delta, ModelInfo, ProcessRequest
from services.common.cache_reset import CacheResetResult
from services.common.config import ClusterConfig
from services.common.errors import ServingError
from services.frontend.body import BodyLimits, read_json
from services.frontend.errors import APIError, ServingErrors, route_error
from services.frontend.guard import REQUEST_ID, CatchAll
from services.frontend.images import resolve_images
from services.frontend.metrics import FrontendMetrics
from services.frontend.prompts import merged
from services.frontend.render import Renderer
from services.frontend.responses import ResponsesRequest, as_responses_error
from services.frontend.responses_render import ResponseEvents, ResponseRenderer
from services.frontend.schemas import ChatCompletionRequest, CompletionRequest
from services.frontend.streaming import (
    ChatEvents,
    ClientGone,
    collect,
    first_delta,
    sse,
    unless_disconnected,
)
from services.frontend.validation import validate

log = logging.getLogger("tandem.frontend")


class ProcessorLike(Protocol):
    def generate(self, req: ProcessRequest) -> AsyncIterator[Delta]: ...
    async def list_models(self) -> list[ModelInfo]: ...


class Readiness(Protocol):
    def ready(self) -> tuple[bool, str]: ...


def create_app(cfg: ClusterConfig, processor: ProcessorLike, readiness: Readiness | None = None,
               metrics: FrontendMetrics | None = None, lifespan: Any = None,
               reset_caches: Callable[[], Awaitable[CacheResetResult]] | None = None) -> FastAPI:
    """The app. ``readiness`` None: /health reports ready (no cluster view to consult).
    ``lifespan``: FastAPI's lifespan context (tests start in-process parts with it).
    ``reset_caches``: what ``POST /reset_prefix_cache`` runs (None: no such route).
    The OpenAPI schema, request bodies included, is served at /openapi.json."""
    fc = cfg.frontend
    m = metrics if metrics is not None else FrontendMetrics()
    app = FastAPI(title="tandem", docs_url=None, redoc_url=None, openapi_url="/openapi.json",
                  lifespan=lifespan)
    _describe_bodies(app)
    app.state.metrics = m
    app.add_middleware(CatchAll, metrics=m)
    app.add_exception_handler(HTTPException, route_error)
    keys = [k.encode() for k in fc.api_keys]
    limits = BodyLimits(fc.max_body_bytes, fc.body_timeout_s)
    errors = ServingErrors(fc.retry_after_s)

    def check_auth(request: Request) -> None:
        if not keys:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not any(hmac.compare_digest(token.strip().encode(), k) for k in keys):
            raise APIError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`",
                           "authentication_error", code="invalid_api_key")

    def check_max_tokens(body: ChatCompletionRequest | CompletionRequest) -> None:
        asked = body.requested_max_tokens()
        if asked is not None and asked > fc.max_tokens_limit:
            param = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens"
            raise APIError(400, f"{param}: {asked} is more than this server allows "
                           f"(frontend.max_tokens_limit={fc.max_tokens_limit})",
                           param=param, code="invalid_value")

    async def chat_process(request: Request, body: ChatCompletionRequest, rid: str) -> ProcessRequest:
        """The processor's request, with the message images fetched and checked."""
        if urls := body.image_urls():
            images = await unless_disconnected(request, resolve_images(urls, cfg.multimodal))
            return body.to_process(rid, images)
        return body.to_process(rid)

    async def run(request: Request, model_cls: type[ChatCompletionRequest] | type[CompletionRequest],
                  chat: bool) -> Response:
        t0 = time.perf_counter()
        rid = uuid.uuid4().hex
        setattr(request.state, REQUEST_ID, rid)  # for guard.CatchAll's log line
        try:
            check_auth(request)
            body = validate(model_cls, await read_json(request, limits))
            check_max_tokens(body)
            # NOTE: the processor checks the model (404 naming the served one) as it
            # starts the request: asking it for the model list first would cost every
            # request another round trip.
            r = Renderer(chat, ("chatcmpl-" if chat else "cmpl-") + rid, body.model,
                         logprobs=body.num_logprobs() is not None, usage=body.stream_usage)
            choices = body.n
            if isinstance(body, CompletionRequest):
                reqs = body.to_processes(rid)
                choices *= len(reqs)
                deltas = (processor.generate(reqs[0]) if len(reqs) == 1
                          else merged(processor.generate, reqs, body.n))
            else:
                deltas = processor.generate(await chat_process(request, body, rid))
            first = await unless_disconnected(request, first_delta(deltas, fc.request_timeout_s))
        except (ServingError, APIError, ClientGone) as e:
            return _fail(m, t0, _api_error(e, errors, rid))
        if body.stream:
            return _streamed(sse(m, ChatEvents(r, choices), deltas, first, t0,
                                 fc.request_timeout_s, errors, rid, choices))
        try:
            choices, usage = await unless_disconnected(
                request, collect(m, deltas, first, t0, fc.request_timeout_s, choices))
        except (ServingError, APIError, ClientGone) as e:
            return _fail(m, t0, _api_error(e, errors, rid))
        return _answered(m, t0, r.full(choices, usage))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await run(request, ChatCompletionRequest, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await run(request, CompletionRequest, chat=False)

    async def served_models(request: Request) -> list[ModelInfo] | Response:
        try:
            check_auth(request)
            return await processor.list_models()
        except APIError as e:
            return e.response()
        except ServingError as e:
            return errors.from_serving_error(e, uuid.uuid4().hex).response()

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        """OpenAI's Responses API, stateless: the request runs as the chat request it
        amounts to (frontend/responses.py) and is answered in its own shape."""
        t0 = time.perf_counter()
        rid = uuid.uuid4().hex
        setattr(request.state, REQUEST_ID, rid)
        where: list[str] = []
        try:
            check_auth(request)
            body = validate(ResponsesRequest, await read_json(request, limits))
            chat, where = body.to_chat()
            check_max_tokens(chat)
            deltas = processor.generate(await chat_process(request, chat, rid))
            first = await unless_disconnected(request, first_delta(deltas, fc.request_timeout_s))
        except (ServingError, APIError, ClientGone) as e:
            return _fail(m, t0, as_responses_error(_api_error(e, errors, rid), where))
        r = ResponseRenderer(body, rid)
        if body.stream:
            return _streamed(sse(m, ResponseEvents(r), deltas, first, t0, fc.request_timeout_s,
                                 errors, rid))
        try:
            (choice,), usage = await unless_disconnected(
                request, collect(m, deltas, first, t0, fc.request_timeout_s))
        except (ServingError, APIError, ClientGone) as e:
            return _fail(m, t0, _api_error(e, errors, rid))
        return _answered(m, t0, r.full(choice, usage))

    @app.api_route("/v1/responses/{rest:path}", methods=["GET", "POST", "DELETE"],
                   include_in_schema=False)
    async def stored_response(request: Request, rest: str) -> Response:
        """Retrieve, delete, cancel and list input items act on stored responses: none is."""
        try:
            check_auth(request)
        except APIError as e:
            return e.response()
        rid = rest.split("/", 1)[0]
        return APIError(404, f"no response {rid!r}: this server stores no responses "
                        "(a request's store must be false or absent)", param="response_id",
                        code="not_found").response()

    @app.get("/v1/models")
    async def list_models(request: Request) -> Response:
        models = await served_models(request)
        if isinstance(models, Response):
            return models
        return JSONResponse({"object": "list", "data": [_model_body(x) for x in models]})

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(request: Request, model: str) -> Response:
        """OpenAI's retrieve (``client.models.retrieve``); ``:path``: an id may hold "/"."""
        models = await served_models(request)
        if isinstance(models, Response):
            return models
        for x in models:
            if x.id == model:
                return JSONResponse(_model_body(x))
        return APIError(404, f"the model {model!r} does not exist; this cluster serves "
                        f"{', '.join(repr(x.id) for x in models)}", param="model",
                        code="model_not_found").response()

    if reset_caches is not None:
        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache(request: Request) -> Response:
            """vLLM's admin route (aiperf's ``--reset-kv-cache`` calls it between runs): every
            decode and prefill worker evicts the cached blocks no running request holds."""
            try:
                check_auth(request)
                _check_reset_params(request)
            except APIError as e:
                return e.response()
            result = await reset_caches()
            workers = len(result.replies) + len(result.missing)
            if result.missing or not workers:
                if result.missing:
                    log.warning("prefix cache reset: no answer within %.1f s from %s",
                                fc.cache_reset_timeout_s, ", ".join(result.missing))
                what = (f"{len(result.missing)} of {workers} workers did not confirm the reset"
                        if workers else "no worker is available")
                return APIError(503, f"{what}, retry later", "service_unavailable", code="no_workers",
                                headers={"Retry-After": str(fc.retry_after_s)}).response()
            return JSONResponse({
                "object": "prefix_cache_reset",
                "evicted_blocks": sum(r.evicted_blocks for r in result.replies),
                "workers": [{"id": r.worker_id, "role": r.role, "evicted_blocks": r.evicted_blocks,
                             "blocks_in_use": r.blocks_in_use} for r in result.replies]})

    @app.get("/health")
    async def health() -> Response:
        ok, why = readiness.ready() if readiness is not None else (True, "ready")
        return JSONResponse({"status": "ready" if ok else "not ready", "detail": why},
                            status_code=200 if ok else 503)

    @app.get("/live")
    async def live() -> Response:
        return JSONResponse({"status": "alive"})

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)

    return app


# ---- helpers ---------------------------------------------------------------------------
def _model_body(x: ModelInfo) -> dict:
    return {"id": x.id, "object": "model", "created": 0, "owned_by": "tandem",
            "context_length": x.context_length}


def _describe_bodies(app: FastAPI) -> None:
    """Put the request body models in the OpenAPI schema: the handlers read the body
    themselves (for the size limit and our 400s), so FastAPI cannot see them."""
    base = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = base()
        comps = schema.setdefault("components", {}).setdefault("schemas", {})
        for path, model in (("/v1/chat/completions", ChatCompletionRequest),
                            ("/v1/completions", CompletionRequest),
                            ("/v1/responses", ResponsesRequest)):
            js = model.model_json_schema(ref_template="#/components/schemas/{model}")
            comps.update(js.pop("$defs", {}))
            comps[model.__name__] = js
            schema["paths"][path]["post"]["requestBody"] = {"required": True, "content": {
                "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def _check_reset_params(request: Request) -> None:
    """vLLM's query parameters of /reset_prefix_cache: each is honoured or refused. It
    takes no body (the tools send none): one would be ignored, so it is refused."""
    if request.headers.get("content-length", "0") != "0" or "transfer-encoding" in request.headers:
        raise APIError(400, "/reset_prefix_cache takes no body; its one parameter, "
                       "reset_running_requests, goes in the query string", code="invalid_body")
    for name, value in request.query_params.multi_items():
        if name != "reset_running_requests":
            raise APIError(400, f"{name}: unknown parameter of /reset_prefix_cache", param=name,
                           code="unknown_parameter")
        if value.lower() not in ("false", "0"):
            raise APIError(400, "reset_running_requests: running requests keep their blocks "
                           "(they are not preempted); only false is supported", param=name,
                           code="unsupported_value")


def _api_error(e: ServingError | APIError | ClientGone, errors: ServingErrors,
               request_id: str) -> APIError:
    """What the client is told for an error raised while a request is served."""
    if isinstance(e, ServingError):
        return errors.from_serving_error(e, request_id)
    if isinstance(e, ClientGone):
        return APIError(499, "the client disconnected")
    return e


def _streamed(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _answered(m: FrontendMetrics, t0: float, body: dict) -> Response:
    """A whole answer; counted once its body is built (if that fails, guard counts a 500)."""
    response = JSONResponse(body)
    m.requests.labels("200").inc()
    m.duration.observe(time.perf_counter() - t0)
    return response


def _fail(m: FrontendMetrics, t0: float, e: APIError) -> Response:
    m.requests.labels(str(e.status)).inc()
    m.duration.observe(time.perf_counter() - t0)
    return e.response()
