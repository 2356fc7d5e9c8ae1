"""AsyncEngine: streaming from a step thread, abort on early close, failure propagation."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest

from services.api.outputs import FinishReason, TokenOutput
from services.api.sampling import SamplingParams
from services.common.config import EngineConfig
from services.engine.async_engine import AsyncEngine, EngineDeadError
from services.engine.batch import RunnerOutput, ScheduledBatch
from services.engine.engine import LLMEngine
from services.engine.request import GenerateRequest
from services.engine.runner.mock_runner import MockRunner
from services.engine.scheduler import InvalidRequestError
from tests.support.engine_factory import EOS, make_engine, mock_cfg, oracle, req


async def drain(ae: AsyncEngine, r: GenerateRequest) -> list[TokenOutput]:
    return [o async for o in ae.generate(r)]


async def idle(ae: AsyncEngine) -> bool:
    """Whether the engine holds no request and no block, after earlier commands ran."""
    for _ in range(200):  # lets a closed generator's finalizer submit its abort
        if not await ae.call(lambda e: e.has_unfinished()):
            await ae.check_integrity()
            return ae.stats().kv_blocks_used == 0
        await asyncio.sleep(0)
    return False


async def test_concurrent_generates_stream_their_own_tokens() -> None:
    eng, runner, _ = make_engine(mock_cfg(max_num_batched_tokens=8))
    reqs = [req(f"r{i}", list(range(10 * i, 10 * i + 5 + 3 * i)), max_tokens=5 + i) for i in range(4)]
    async with AsyncEngine(eng) as ae:
        results = await asyncio.gather(*(drain(ae, r) for r in reqs))
        for r, outs in zip(reqs, results, strict=True):
            assert all(o.token_ids for o in outs)  # several when the consumer fell behind
            assert [t for o in outs for t in o.token_ids] == oracle(eng, runner, r)[0]
            assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        assert await idle(ae)
        steps = runner.num_steps
        await asyncio.sleep(0.05)
        assert runner.num_steps == steps  # idle: the step thread sleeps, no empty steps


class GatedRunner(MockRunner):
    """Runs one step per permit, so a test knows a request cannot finish behind its back."""

    def __init__(self, cfg: EngineConfig, permits: int) -> None:
        super().__init__(cfg)
        self.gate = threading.Semaphore(permits)
        self.entered = threading.Event()  # a step is running (or waiting for its permit)

    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        self.entered.set()
        self.gate.acquire()
        return super().execute(batch)


def gated_engine(permits: int = 2) -> tuple[LLMEngine, GatedRunner]:
    cfg = mock_cfg()
    runner = GatedRunner(cfg, permits)
    return LLMEngine(runner, cfg, [EOS]), runner


async def test_consumer_that_closes_early_aborts_and_frees_blocks() -> None:
    eng, runner = gated_engine()
    async with AsyncEngine(eng) as ae:
        async with contextlib.aclosing(ae.generate(req("a", [1, 2, 3], max_tokens=200))) as gen:
            async for o in gen:
                assert o.token_ids and not o.finished
                break
        runner.gate.release(1000)  # the abort is queued already: at most one more step
        assert await idle(ae)
        assert runner.num_steps <= 3


async def test_consumer_that_just_breaks_aborts_via_the_generator_finalizer() -> None:
    eng, runner = gated_engine()
    async with AsyncEngine(eng) as ae:
        async for _ in ae.generate(req("b", [4, 5, 6], max_tokens=200)):
            break
        while "b" in ae._queues:  # the finalizer's aclose() runs as a task
            await asyncio.sleep(0)
        runner.gate.release(1000)
        assert await idle(ae)
        assert runner.num_steps <= 3


async def test_cancelled_consumer_task_aborts_its_request() -> None:
    eng, runner = gated_engine()
    async with AsyncEngine(eng) as ae:
        started = asyncio.Event()

        async def consume() -> None:
            async for _ in ae.generate(req("c", [7, 8, 9], max_tokens=200)):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        runner.gate.release(1000)
        assert await idle(ae)


async def test_prefix_query_answers_while_a_step_runs() -> None:
    """A remote-prefill decision reads the prefix cache during a long step: the answer must
    not wait for the step's end (it did, by up to a 768-token prefill, ~1.3 s on a CPU)."""
    eng, runner = gated_engine(permits=0)
    prompt = list(range(100, 140))
    async with AsyncEngine(eng) as ae:
        async with contextlib.aclosing(ae.generate(req("held", prompt, max_tokens=3))) as gen:
            first = asyncio.ensure_future(anext(gen))
            assert await asyncio.to_thread(runner.entered.wait, 5.0)
            assert ae.prefix_hit_tokens(prompt) == 0 and not first.done()
            runner.gate.release(1000)
            await first
            async for _ in gen:
                pass
        assert ae.prefix_hit_tokens(prompt + [1]) == len(prompt)  # its full blocks, cached
        assert await idle(ae)


async def test_explicit_abort_ends_the_stream_with_abort() -> None:
    eng, runner = gated_engine()
    async with AsyncEngine(eng) as ae:
        outs = []
        async for o in ae.generate(req("a", [1, 2, 3], max_tokens=200)):
            outs.append(o)
            if len(outs) == 1:
                await ae.abort("a")
                runner.gate.release(1000)
        assert outs[-1].finish_reason is FinishReason.ABORT and outs[-1].token_ids == []
        assert len(outs) <= 4
        assert await idle(ae)


async def test_bad_request_raises_at_once_and_engine_keeps_going() -> None:
    eng, runner, _ = make_engine()
    async with AsyncEngine(eng) as ae:
        with pytest.raises(InvalidRequestError, match="prompt is empty"):
            ae.validate(req("e", []))
        r = req("ok", [3, 4], max_tokens=3)
        assert [t for o in await drain(ae, r) for t in o.token_ids] == oracle(eng, runner, r)[0]


async def test_a_live_request_id_is_refused_and_the_first_request_is_untouched() -> None:
    eng, runner = gated_engine()
    async with AsyncEngine(eng) as ae:
        r = req("a", [1, 2, 3], max_tokens=3)
        async with contextlib.aclosing(ae.generate(r)) as gen:
            toks = list((await anext(gen)).token_ids)  # registered and stepping
            with pytest.raises(InvalidRequestError, match="already live"):
                await drain(ae, req("a", [4, 5]))
            with pytest.raises(InvalidRequestError, match="already live"):
                await ae.begin_remote_prefill(req("a", [4, 5]))
            runner.gate.release(1000)
            toks += [t async for o in gen for t in o.token_ids]
        assert toks == oracle(eng, runner, r)[0]
        assert await idle(ae)


async def test_kv_spec_is_the_runners() -> None:
    eng, runner, _ = make_engine()
    async with AsyncEngine(eng) as ae:
        assert ae.kv_spec == runner.kv_spec


class ExplodingRunner(MockRunner):
    """A runner whose forward fails on its third step (a device error, say)."""

    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        if self.num_steps == 2:
            raise RuntimeError("device lost")
        return super().execute(batch)


async def test_runner_exception_fails_every_in_flight_request() -> None:
    cfg = mock_cfg()
    eng = LLMEngine(ExplodingRunner(cfg), cfg, [EOS])
    ae = AsyncEngine(eng)
    await ae.start()
    results = await asyncio.gather(
        *(drain(ae, req(f"r{i}", [i + 1, 2, 3], max_tokens=50)) for i in range(3)),
        return_exceptions=True)
    assert all(isinstance(r, EngineDeadError) for r in results)
    assert "device lost" in str(results[0])
    with pytest.raises(EngineDeadError):
        await drain(ae, req("late", [1, 2]))
    with pytest.raises(EngineDeadError):
        await ae.check_integrity()
    await ae.shutdown()


async def test_remote_prefill_through_the_async_api() -> None:
    eng, runner, _ = make_engine(worker_id="d")
    prefill, _, _ = make_engine(worker_id="p")
    prompt = list(range(40, 53))
    r = req("x", prompt, max_tokens=4)
    async with AsyncEngine(eng) as ae, AsyncEngine(prefill) as pe:
        assert ae.prefix_hit_tokens(prompt) == 0
        handle = await ae.begin_remote_prefill(r)
        assert handle is not None and handle.num_blocks_to_fill == 4
        p_out = await drain(pe, GenerateRequest("x", prompt, SamplingParams(max_tokens=1),
                                                export_kv_from_block=handle.first_block_to_fill))
        stream = ae.stream("x")
        first = await ae.complete_remote_prefill("x", p_out[-1].kv, p_out[-1].token_ids[0])
        assert first is not None
        toks = [t async for o in stream for t in o.token_ids]
        assert toks == oracle(eng, runner, r)[0]
        assert ae.prefix_hit_tokens(prompt) == 12
        assert await idle(ae)


async def test_shutdown_fails_a_request_still_waiting() -> None:
    eng, _, _ = make_engine()
    ae = AsyncEngine(eng)
    await ae.start()
    assert await ae.begin_remote_prefill(req("parked", list(range(9)))) is not None
    waiter = asyncio.create_task(_read(ae, "parked"))
    await asyncio.sleep(0)
    await ae.shutdown()
    with pytest.raises(EngineDeadError, match="shut down"):
        await waiter


async def _read(ae: AsyncEngine, rid: str) -> list[TokenOutput]:
    return [o async for o in ae.stream(rid)]


async def test_a_consumer_that_keeps_up_gets_one_token_per_output() -> None:
    # NOTE: two permits: with overlap scheduling a step's output goes out once the next
    # step is launched
    eng, runner = gated_engine(permits=2)
    async with AsyncEngine(eng) as ae:
        outs = []
        async for o in ae.generate(req("k", [1, 2, 3], max_tokens=6)):
            outs.append(o)
            runner.gate.release()  # one more step only once this output was read
        # the last step's output follows its predecessor's with no launch between: those
        # two may come together
        assert [len(o.token_ids) for o in outs[:4]] == [1] * 4
        assert sum(len(o.token_ids) for o in outs) == 6
        assert outs[-1].finished and outs[-1].finish_reason is FinishReason.LENGTH
        assert await idle(ae)


async def test_a_consumer_that_falls_behind_gets_the_queued_tokens_as_one_output() -> None:
    """Tokens (and their logprobs) made while nobody read come as one output carrying the
    finish, equal to what a reader that kept up saw token by token."""
    eng, runner = gated_engine(permits=2)  # the first output (see keeps_up above)
    r = req("s", [1, 2, 3], max_tokens=5, logprobs=1)
    async with AsyncEngine(eng) as ae:
        async with contextlib.aclosing(ae.generate(r)) as gen:
            first = await anext(gen)
            runner.gate.release(3)
            while await ae.call(lambda e: e.has_unfinished()):
                await asyncio.sleep(0.01)
            rest = [o async for o in gen]
        assert len(rest) == 1, [o.token_ids for o in rest]
        outs = [first, *rest]
        tokens = [t for o in outs for t in o.token_ids]
        assert tokens == oracle(eng, runner, r)[0] and len(rest[0].token_ids) >= 2
        assert rest[0].finished and rest[0].finish_reason is FinishReason.LENGTH
        assert len([lp for o in outs for lp in (o.logprobs or [])]) == len(tokens)
        assert await idle(ae)


async def test_a_prompt_submitted_between_steps_counts_as_prefill_pending() -> None:
    """The step thread takes a new request only between steps; until then stats() counts
    its prompt pending, so a decision taken meanwhile (a burst's) sees it; once it is in the
    engine it is counted there, once."""
    eng, runner = gated_engine(permits=0)
    async with AsyncEngine(eng) as ae:
        a = asyncio.create_task(drain(ae, req("a", [1, 2, 3], max_tokens=2)))
        for _ in range(100):  # the step thread takes "a" and blocks in its first step
            await asyncio.sleep(0.001)
            if eng.scheduler.running:
                break
        assert ae.stats().num_prefill_tokens_pending == 0  # "a"'s prompt is in the step
        b = asyncio.create_task(drain(ae, req("b", list(range(20, 31)), max_tokens=2)))
        await asyncio.sleep(0)
        assert ae.stats().num_prefill_tokens_pending == 11  # "b": submitted, not yet taken
        for _ in range(20):
            runner.gate.release()
        await asyncio.gather(a, b)
        assert ae.stats().num_prefill_tokens_pending == 0
        assert ae._adding_tokens == 0
        assert await idle(ae)
