"""engine.stream_interval: after a choice's first token, its tokens are handed on together
(fewer messages through the hops), never lost, reordered or held past the choice's end or
past a step without a token of it."""

from __future__ import annotations

import asyncio

import pytest

from services.api.outputs import FinishReason, TokenOutput
from services.common.config import EngineConfig
from services.engine.async_engine import (
    AUTO_STREAM_INTERVAL,
    AUTO_STREAM_SEQS,
    AsyncEngine,
    RequestMoving,
)
from services.engine.factory import stream_interval
from tests.support.engine_factory import make_engine, mock_cfg, oracle, req
from tests.unit.engine.test_async_engine import gated_engine, idle


def tok(rid: str, t: int, index: int = 0, **kw: object) -> TokenOutput:
    return TokenOutput(rid, [t], index=index, **kw)  # type: ignore[arg-type]


def queued(ae: AsyncEngine, rid: str) -> list[TokenOutput | BaseException]:
    q = ae._queues[rid]
    return [q.get_nowait() for _ in range(q.qsize())]


def bare(interval: int | str, rids: list[str]) -> AsyncEngine:
    """An AsyncEngine not started, its requests registered: _dispatch is driven by hand."""
    eng, _, _ = make_engine()
    ae = AsyncEngine(eng, interval)  # type: ignore[arg-type]
    for rid in rids:
        ae._register(rid)
    return ae


def test_interval_three_hands_on_the_first_token_then_threes() -> None:
    ae = bare(3, ["a"])
    for t in range(7):
        ae._dispatch([tok("a", t)])
    got = queued(ae, "a")
    assert [o.token_ids for o in got] == [[0], [1, 2, 3], [4, 5, 6]]  # type: ignore[union-attr]
    ae._dispatch([tok("a", 7, finished=True, finish_reason=FinishReason.STOP)])
    (last,) = queued(ae, "a")
    assert last.token_ids == [7] and last.finished  # type: ignore[union-attr]


def test_the_end_goes_out_with_what_was_held() -> None:
    ae = bare(4, ["a"])
    ae._dispatch([tok("a", 0)])
    ae._dispatch([tok("a", 1, logprobs=None)])
    ae._dispatch([tok("a", 2, finished=True, finish_reason=FinishReason.LENGTH)])
    first, last = queued(ae, "a")
    assert first.token_ids == [0]  # type: ignore[union-attr]
    assert last.token_ids == [1, 2] and last.finished  # type: ignore[union-attr]
    assert last.finish_reason is FinishReason.LENGTH  # type: ignore[union-attr]


def test_auto_holds_only_in_steps_of_many_sequences() -> None:
    many = [f"r{i}" for i in range(AUTO_STREAM_SEQS)]
    ae = bare("auto", many)
    for t in range(1 + 2 * AUTO_STREAM_INTERVAL):
        ae._dispatch([tok(rid, t) for rid in many])
    for rid in many:
        assert [len(o.token_ids) for o in queued(ae, rid)] == [1, AUTO_STREAM_INTERVAL, AUTO_STREAM_INTERVAL]  # type: ignore[union-attr]
    few = many[: AUTO_STREAM_SEQS - 1]
    ae = bare("auto", few)
    for t in range(3):
        ae._dispatch([tok(rid, t) for rid in few])
    for rid in few:
        assert [o.token_ids for o in queued(ae, rid)] == [[0], [1], [2]]  # type: ignore[union-attr]


def test_a_step_without_a_token_of_it_releases_what_was_held() -> None:
    """A preempted or migrating choice does not keep its tokens back."""
    ae = bare(3, ["a", "b"])
    ae._dispatch([tok("a", 0), tok("b", 0)])
    ae._dispatch([tok("a", 1), tok("b", 1)])
    assert [o.token_ids for o in queued(ae, "a")] == [[0]]  # type: ignore[union-attr]
    ae._dispatch([tok("b", 2)])  # "a" made nothing this step
    assert [o.token_ids for o in queued(ae, "a")] == [[1]]  # type: ignore[union-attr]
    assert [o.token_ids for o in queued(ae, "b")] == [[0]]  # type: ignore[union-attr]
    assert list(ae._held) == ["b"]  # [1, 2]: one short of the interval


def test_held_tokens_go_before_a_move_or_an_error() -> None:
    ae = bare(3, ["a", "b"])
    for t in range(2):
        ae._dispatch([tok("a", t), tok("b", t)])
    ae._deliver("a", RequestMoving("a", True))
    ae._dispatch([tok("b", 2, error="grammar failed", finished=True, finish_reason=FinishReason.ERROR)])
    a = queued(ae, "a")
    assert [o.token_ids for o in a[:2]] == [[0], [1]] and isinstance(a[2], RequestMoving)  # type: ignore[union-attr]
    b = queued(ae, "b")
    assert [o.token_ids for o in b[:2]] == [[0], [1]]  # type: ignore[union-attr]
    assert len(b) == 3 and isinstance(b[2], Exception) and "grammar failed" in str(b[2])


def test_choices_are_held_apart() -> None:
    ae = bare(2, ["a"])
    for t in range(3):
        ae._dispatch([tok("a", 10 + t, index=0), tok("a", 20 + t, index=1)])
    got = queued(ae, "a")
    by_index: dict[int, list[list[int]]] = {}
    for o in got:
        by_index.setdefault(o.index, []).append(o.token_ids)  # type: ignore[union-attr]
    assert by_index == {0: [[10], [11, 12]], 1: [[20], [21, 22]]}


async def test_streams_through_the_engine_equal_the_oracle_and_leave_nothing_behind() -> None:
    eng, runner, _ = make_engine(mock_cfg(max_num_batched_tokens=64))
    reqs = [req(f"r{i}", list(range(10 * i, 10 * i + 5)), max_tokens=9 + i) for i in range(4)]
    reqs.append(req("n2", [7, 8, 9], max_tokens=7, n=2, seed=3, temperature=1.0))
    async with AsyncEngine(eng, 3) as ae:
        async def drain(r):  # type: ignore[no-untyped-def]
            return [o async for o in ae.generate(r)]
        results = await asyncio.gather(*(drain(r) for r in reqs))
        for r, outs in zip(reqs[:4], results[:4], strict=True):
            assert [t for o in outs for t in o.token_ids] == oracle(eng, runner, r)[0]
            # (a first output of several tokens: the reader fell behind and coalesced)
            assert all(len(o.token_ids) >= 3 for o in outs[1:-1]), [o.token_ids for o in outs]
            assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        for index in (0, 1):
            mine = [o for o in results[4] if o.index == index]
            assert sum(len(o.token_ids) for o in mine) == 7 and mine[-1].finished
        assert not ae._held and not ae._started
        assert await idle(ae)


async def test_a_consumer_that_keeps_up_gets_its_first_token_alone_then_fours() -> None:
    eng, runner = gated_engine(permits=2)

    async def steps() -> None:  # one step at a time, slower than the reader
        for _ in range(12):
            await asyncio.sleep(0.005)
            runner.gate.release()

    async with AsyncEngine(eng, 4) as ae:
        stepping = asyncio.create_task(steps())
        outs = [o async for o in ae.generate(req("k", [1, 2, 3], max_tokens=9))]
        await stepping
        assert len(outs[0].token_ids) == 1
        assert all(len(o.token_ids) >= 4 for o in outs[1:-1]) and len(outs) <= 3
        assert sum(len(o.token_ids) for o in outs) == 9 and outs[-1].finished
        assert await idle(ae)


def test_auto_is_per_token_on_the_mock_runner_and_a_number_is_kept() -> None:
    assert stream_interval(EngineConfig(runner="mock")) == 1
    assert stream_interval(EngineConfig()) == "auto"
    assert stream_interval(EngineConfig(runner="mock", stream_interval=3)) == 3
    with pytest.raises(ValueError):
        EngineConfig(stream_interval=0)
    with pytest.raises(ValueError):
        AsyncEngine(make_engine()[0], 0)
