"""The Processor part: text in, text deltas out.

``generate(ProcessRequest)`` runs a request through the stages in services/processor/stages/,
in order: the prompt (chat template, tokens, checked against the context), its sampling
settings, the router's decode worker, that worker's tokens streamed as text (one choice or
``n``, migrating when the worker fails), the tool calls read out of the text,
the prompt echoed (completions' ``echo``), and the ledger (outcome metrics, the router's FINISHED). The router is the in-process
``Router`` or a ``RouterClient`` (same ``route``/``update``).

Router bookkeeping: ``update(PREFILLED)`` at the first token, ``update(FINISHED)`` at the end
whatever the end was (finish, stop string, error, cancellation), so no load leaks. A deployed
processor publishes both on NATS, so neither holds up a token: see ``RouterReports``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from services.api.processor import Delta, ModelInfo, ProcessRequest
from services.common.errors import ServingError
from services.model.tokenizer import Tokenizer
from services.processor.images import ImagePrompting
from services.processor.metrics import ProcessorMetrics
from services.processor.router_reports import Publish, RouterLike, RouterReports
from services.processor.stages.choices import ChoicesStage
from services.processor.stages.echo import Echo
from services.processor.stages.ledger import Ledger
from services.processor.stages.prompt import PromptStage
from services.processor.stages.route import RouteStage
from services.processor.stages.sampling import resolve_sampling, stop_matcher
from services.processor.stages.stream import StreamStage
from services.processor.stages.tool_calls import ToolCallStage
from services.processor.stages.workers import WorkerLike
from services.processor.worker_client import DecodeWorkerClient


class Processor:
    def __init__(
        self,
        tokenizer: Tokenizer,
        router: RouterLike,
        workers: WorkerLike | DecodeWorkerClient,
        model_name: str,
        context_length: int,
        block_size: int = 16,
        metrics: ProcessorMetrics | None = None,
        migration_limit: int = 3,
        publish_reports: Publish | None = None,
        instance: str = "processor",
        images: ImagePrompting | None = None,  # None: a text-only model
    ) -> None:
        self.model_name = model_name
        self.context_length = context_length
        self.metrics = metrics if metrics is not None else ProcessorMetrics()
        self.reports = RouterReports(router, publish_reports, instance)
        self._tok = tokenizer
        self._prompts = PromptStage(tokenizer, model_name, context_length, images)
        self._routes = RouteStage(router, self.reports, block_size)
        self._stream = StreamStage(tokenizer, workers, self._routes, self.reports, self.metrics,
                                   migration_limit)
        self._choices = ChoicesStage(tokenizer, workers, self._routes, self.reports, self.metrics,
                                     migration_limit, self._stream)

    async def list_models(self) -> list[ModelInfo]:
        return [ModelInfo(self.model_name, self.context_length)]

    async def generate(self, req: ProcessRequest) -> AsyncIterator[Delta]:
        """Stream the answer. Raises InvalidRequest, ModelNotFound or Unavailable before the
        first delta for a request that cannot start; closing the iterator aborts it."""
        rid = req.request_id
        try:
            prompt = self._prompts.build(req)
            sampling = resolve_sampling(req.sampling, len(prompt.ids), self._tok.vocab_size,
                                        self.context_length)
            stops = stop_matcher(req.sampling.stop)
            route = await self._routes.route(rid, prompt)
        except ServingError as e:
            self.metrics.requests.labels(e.kind).inc()
            raise
        ledger = Ledger(self.metrics, self.reports, rid, len(prompt.ids))
        tools = ToolCallStage.for_request(req)
        echo = Echo.for_request(self._tok, req, prompt)
        try:
            stream = (self._stream.stream(rid, prompt, sampling, stops, route, echo)
                      if sampling.n == 1 else self._choices.stream(rid, prompt, sampling, route, echo))
            async for out in stream:
                delta = tools.apply(out) if tools is not None else out
                if delta is None:
                    continue
                if echo is not None:
                    delta = echo.apply(delta)
                if ledger.note(delta):  # the request's last delta
                    await ledger.release()
                yield delta
        except Exception as e:
            ledger.failed(e)
            raise
        finally:
            await ledger.close()
