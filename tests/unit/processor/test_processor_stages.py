"""The processor's stages alone (services/processor/stages/), over fakes: a scripted router
and scripted decode workers, a tokenizer where token ``i`` is the letter ``i % 26``."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import pytest

from services.api.outputs import FinishReason, TokenLogprob, TokenOutput, Usage
from services.api.processor import (
    ChatMessage,
    Delta,
    ProcessRequest,
    TextLogprob,
    Tool,
    ToolChoice,
)
from services.api.route import RequestPhase, RouteRequest, RouteResponse
from services.api.sampling import SamplingParams
from services.common.errors import InvalidRequest, ModelNotFound, Overloaded, Unavailable
from services.processor.metrics import ProcessorMetrics
from services.processor.router_reports import RouterReports
from services.processor.stages.echo import Echo
from services.processor.stages.ledger import Ledger
from services.processor.stages.migrate import Migration
from services.processor.stages.prompt import Prompt, PromptStage
from services.processor.stages.route import RouteStage, routed_cached_tokens
from services.processor.stages.sampling import resolve_sampling, stop_matcher
from services.processor.stages.stream import StreamStage
from services.processor.stages.tool_calls import ToolCallStage
from services.processor.tools import CLOSE, OPEN

VOCAB = 100
BS = 4


class Letters:
    """Token ``i`` decodes to the letter ``i % 26``."""

    vocab_size = VOCAB

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)


class ScriptedRouter:
    """Routes to the next worker of ``workers`` not excluded; keeps what it was asked."""

    def __init__(self, workers: Sequence[tuple[str, str]]) -> None:
        self.workers = list(workers)  # (worker id, address)
        self.routed: list[RouteRequest] = []
        self.updates: list[tuple[str, RequestPhase]] = []

    async def route(self, req: RouteRequest) -> RouteResponse:
        self.routed.append(req)
        for wid, address in self.workers:
            if wid not in req.exclude_workers:
                return RouteResponse(wid, 1, 2, 0.5, address)
        raise Unavailable("no decode worker")

    async def update(self, request_id: str, phase: RequestPhase) -> None:
        self.updates.append((request_id, phase))


class ScriptedWorkers:
    """Per address: the tokens it sends, one per message, then how it ends: "stop", an
    exception it raises, or None for a stream that ends unfinished."""

    def __init__(self, script: dict[str, tuple[list[int], str | Exception | None]]) -> None:
        self.script = script
        self.calls: list[tuple[str, list[int], SamplingParams]] = []

    async def generate(self, address: str, request_id: str, token_ids: Sequence[int],
                       sampling: SamplingParams) -> AsyncIterator[TokenOutput]:
        self.calls.append((address, list(token_ids), sampling))
        tokens, end = self.script[address]
        for t in tokens[: sampling.max_tokens]:
            yield TokenOutput(request_id, [t], False)
        if isinstance(end, Exception):
            raise end
        if end == "stop":
            yield TokenOutput(request_id, [], True, FinishReason.STOP, 7)


def _stages(router: ScriptedRouter, workers: ScriptedWorkers, limit: int = 3
            ) -> tuple[StreamStage, RouteStage, ProcessorMetrics]:
    metrics = ProcessorMetrics()
    reports = RouterReports(router)
    routes = RouteStage(router, reports, BS)
    return StreamStage(Letters(), workers, routes, reports, metrics, limit), routes, metrics  # type: ignore[arg-type]


def test_sampling_resolves_max_tokens_against_the_context_and_checks_ids() -> None:
    assert resolve_sampling(SamplingParams(), 10, VOCAB, 64).max_tokens == 54
    assert resolve_sampling(SamplingParams(max_tokens=100), 10, VOCAB, 64).max_tokens == 54
    assert resolve_sampling(SamplingParams(max_tokens=5), 10, VOCAB, 64).max_tokens == 5
    with pytest.raises(InvalidRequest) as e:
        resolve_sampling(SamplingParams(stop_token_ids=(VOCAB,)), 10, VOCAB, 64)
    assert e.value.param == "stop_token_ids"
    with pytest.raises(InvalidRequest) as e:
        stop_matcher(("",))
    assert e.value.param == "stop"


def test_prompt_checks_model_input_and_context() -> None:
    stage = PromptStage(Letters(), "m", 8)  # type: ignore[arg-type]
    assert stage.build(ProcessRequest("r", prompt_ids=(1, 2, 3))) == Prompt([1, 2, 3])
    with pytest.raises(ModelNotFound):
        stage.build(ProcessRequest("r", prompt_ids=(1,), model="other"))
    with pytest.raises(InvalidRequest, match="exactly one"):
        stage.build(ProcessRequest("r", prompt="x", prompt_ids=(1,)))
    with pytest.raises(InvalidRequest) as e:
        stage.build(ProcessRequest("r", prompt_ids=tuple(range(8))))
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(InvalidRequest) as e:
        stage.build(ProcessRequest("r", messages=(ChatMessage("robot", "hi"),)))
    assert e.value.param == "messages.0.role"


async def test_route_sends_hashes_or_a_short_prompts_ids() -> None:
    router = ScriptedRouter([("w0", "a0")])
    routes = RouteStage(router, RouterReports(router), BS)
    await routes.route("r", Prompt([1, 2]))
    await routes.route("r", Prompt([1, 2, 3]), produced=[4, 5], exclude=("w9",))
    short, long = router.routed
    assert list(short.token_ids) == [1, 2] and short.local_hashes is None
    assert list(long.token_ids) == [] and len(long.local_hashes or ()) == 1
    assert tuple(long.exclude_workers) == ("w9",)
    assert routed_cached_tokens(RouteResponse("w0", 3, 3, 1.0, "a0"), BS, Prompt([1] * 10)) == 10


async def test_a_worker_without_an_address_is_unavailable_and_released() -> None:
    router = ScriptedRouter([("w0", "")])
    with pytest.raises(Unavailable, match="no gRPC address"):
        await RouteStage(router, RouterReports(router), BS).route("r", Prompt([1]))
    assert router.updates == [("r", RequestPhase.FINISHED)]


async def test_stream_migrates_and_the_text_continues() -> None:
    router = ScriptedRouter([("w0", "a0"), ("w1", "a1")])
    workers = ScriptedWorkers({"a0": ([0, 1], Unavailable("gone")), "a1": ([2, 3, 4], "stop")})
    stream, routes, metrics = _stages(router, workers)
    prompt = Prompt([7, 8, 9])
    route = await routes.route("r", prompt)
    sp = SamplingParams(max_tokens=5, seed=1)
    out = [d async for d in stream.stream("r", prompt, sp, stop_matcher(()), route)]
    assert "".join(d.text for d in out) == "abcde"
    # The second worker got the prompt and what was produced, the rest of the budget and
    # the seeded draws continued.
    (a0, ids0, sp0), (a1, ids1, sp1) = workers.calls
    assert (a0, ids0, sp0.max_tokens, sp0.seed_step_offset) == ("a0", [7, 8, 9], 5, 0)
    assert (a1, ids1, sp1.max_tokens, sp1.seed_step_offset) == ("a1", [7, 8, 9, 0, 1], 3, 2)
    assert list(router.routed[1].exclude_workers) == ["w0"]
    # Migrated: the cached count is the router's view of the new worker, not the worker's.
    assert out[-1].finish_reason is FinishReason.STOP and out[-1].usage == Usage(3, 5, 3)
    # The running count goes on across the move: the new worker's tokens add to the old's.
    counts = [d.tokens for d in out]
    assert counts == sorted(counts) and counts[-1] == 5 and counts[0] < 5
    assert {d.prompt_tokens for d in out} == {3}
    assert metrics.migrations._value.get() == 1
    assert ("r", RequestPhase.FINISHED) in router.updates  # the failed worker's load released


async def test_stream_cut_by_a_stop_string_counts_what_was_produced() -> None:
    router = ScriptedRouter([("w0", "a0")])
    workers = ScriptedWorkers({"a0": ([0, 1, 2, 3], "stop")})
    stream, routes, _ = _stages(router, workers)
    prompt = Prompt([7])
    route = await routes.route("r", prompt)
    out = [d async for d in stream.stream("r", prompt, SamplingParams(max_tokens=9),
                                          stop_matcher(("bc",)), route)]
    # "b" is held back until "c" completes the stop string; the worker's usage never comes
    # (it is cancelled), so the cached count is the router's view. Each delta counts the
    # tokens produced up to it, the held "b" included.
    assert out == [Delta("a", tokens=1, prompt_tokens=1),
                   Delta("", FinishReason.STOP, Usage(1, 3, 1), tokens=3, prompt_tokens=1)]


async def test_every_worker_full_is_overloaded_not_unavailable() -> None:
    router = ScriptedRouter([("w0", "a0"), ("w1", "a1")])
    full = Overloaded("queue full")
    workers = ScriptedWorkers({"a0": ([], full), "a1": ([], full)})
    stream, routes, _ = _stages(router, workers)
    prompt = Prompt([7])
    route = await routes.route("r", prompt)
    with pytest.raises(Overloaded) as e:
        [d async for d in stream.stream("r", prompt, SamplingParams(max_tokens=4),
                                        stop_matcher(()), route)]
    assert e.value.code == "overloaded"


async def test_migration_gives_up_at_its_limit() -> None:
    router = ScriptedRouter([("w0", "a0"), ("w1", "a1")])
    reports = RouterReports(router)
    routes = RouteStage(router, reports, BS)
    prompt = Prompt([7])
    migration = Migration(routes, reports, ProcessorMetrics(), 1, "r", prompt)
    first = await routes.route("r", prompt)
    second = await migration.move(first, [1], "died")
    assert second.worker_id == "w1" and migration.moved
    with pytest.raises(Unavailable, match="gave up after 1 migrations"):
        await migration.move(second, [1, 2], "died")


def test_tool_calls_are_parsed_per_choice() -> None:
    tool = Tool("f")
    assert ToolCallStage.for_request(ProcessRequest("r", prompt="x")) is None
    assert ToolCallStage.for_request(
        ProcessRequest("r", prompt="x", tools=(tool,), tool_choice=ToolChoice("none"))) is None
    stage = ToolCallStage.for_request(ProcessRequest("r", prompt="x", tools=(tool,)))
    assert stage is not None
    assert stage.apply(Delta(f"hi {OPEN}", index=0)) == Delta("hi ", index=0)
    assert stage.apply(Delta("plain", index=1)) == Delta("plain", index=1)
    assert stage.apply(Delta('{"name": "f", "arguments": {}}', index=0)) is None  # held
    last = stage.apply(Delta(CLOSE, FinishReason.STOP, index=0))
    assert last is not None and last.text == "" and [c.name for c in last.tool_calls] == ["f"]
    usage = stage.apply(Delta("", usage=Usage(1, 2, 0)))
    assert usage is not None and usage.usage == Usage(1, 2, 0)


def test_parallel_tool_calls_false_answers_with_the_first_call_alone() -> None:
    tools = (Tool("f"), Tool("g"))
    two = (f'{OPEN}{{"name": "g", "arguments": {{"a": 1}}}}{CLOSE}\n'
           f'{OPEN}{{"name": "f", "arguments": {{}}}}{CLOSE}')
    for parallel, names in ((True, ["g", "f"]), (False, ["g"])):
        stage = ToolCallStage.for_request(ProcessRequest("r", prompt="x", tools=tools,
                                                         parallel_tool_calls=parallel))
        assert stage is not None
        last = stage.apply(Delta(two, FinishReason.STOP))
        assert last is not None and [c.name for c in last.tool_calls] == names


class _Letters:
    """Token id i decodes to chr(97 + i), its bytes are those of chr(65 + i)."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(97 + i) for i in ids)

    def token_bytes(self, token_id: int) -> bytes:
        return chr(65 + token_id).encode()


def test_echo_puts_the_prompt_and_its_logprobs_before_each_choice() -> None:
    req = ProcessRequest("r", prompt_ids=(0, 1, 2), echo=True,
                         sampling=SamplingParams(prompt_logprobs=1, logprobs=1, n=2))
    echo = Echo.for_request(_Letters(), req, Prompt([0, 1, 2]))
    assert echo is not None
    echo.take([TokenLogprob(1, -0.5, ((3, -0.25),)), TokenLogprob(2, -1.5, ((2, -1.5),))])
    gen = TextLogprob("d", -0.1)
    first = echo.apply(Delta("d", logprobs=(gen,), index=1))
    assert first.text == "abcd" and first.index == 1
    assert first.logprobs == (TextLogprob("a", None, token_bytes=b"A"),
                              TextLogprob("b", -0.5, (("d", -0.25),), b"B", (b"D",)),
                              TextLogprob("c", -1.5, (("c", -1.5),), b"C", (b"C",)), gen)
    assert echo.apply(Delta("e", index=1)) == Delta("e", index=1)  # once per choice
    assert echo.apply(Delta("", FinishReason.LENGTH, index=0)).text == "abc"
    assert echo.apply(Delta("", usage=Usage(3, 2, 0))) == Delta("", usage=Usage(3, 2, 0))
    plain = Echo.for_request(_Letters(), ProcessRequest("r", prompt="xyz", echo=True), Prompt([0]))
    assert plain is not None and plain.apply(Delta("!")) == Delta("xyz!")
    assert Echo.for_request(_Letters(), ProcessRequest("r", prompt="xyz"), Prompt([0])) is None


def test_echo_without_the_asked_prompt_logprobs_is_unavailable() -> None:
    req = ProcessRequest("r", prompt="abc", echo=True, sampling=SamplingParams(prompt_logprobs=0))
    echo = Echo.for_request(_Letters(), req, Prompt([0, 1, 2]))
    assert echo is not None
    echo.take(None)
    with pytest.raises(Unavailable, match="no prompt logprobs"):
        echo.apply(Delta("d"))


async def test_ledger_counts_the_outcome_and_releases_once() -> None:
    router = ScriptedRouter([])
    metrics = ProcessorMetrics()
    ledger = Ledger(metrics, RouterReports(router), "r", 5)
    assert metrics.inflight._value.get() == 1
    assert not ledger.note(Delta("x"))
    assert ledger.note(Delta("", FinishReason.LENGTH, Usage(5, 1, 0)))
    await ledger.release()
    await ledger.close()
    assert router.updates == [("r", RequestPhase.FINISHED)]
    assert metrics.requests.labels("length")._value.get() == 1
    assert metrics.inflight._value.get() == 0
    assert metrics.prompt_tokens._value.get() == 5

    cancelled = Ledger(metrics, RouterReports(router), "c", 1)
    await cancelled.close()
    failed = Ledger(metrics, RouterReports(router), "f", 1)
    failed.failed(Unavailable("gone"))
    await failed.close()
    broken = Ledger(metrics, RouterReports(router), "b", 1)
    broken.failed(RuntimeError("bug"))
    await broken.close()
    assert router.updates[1:] == [(x, RequestPhase.FINISHED) for x in "cfb"]
    assert metrics.requests.labels("cancelled")._value.get() == 1
    assert metrics.requests.labels("unavailable")._value.get() == 1
    assert metrics.requests.labels("error")._value.get() == 1
