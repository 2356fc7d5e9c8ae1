"""Scheduler: strict FIFO, chunking, the token budget, preemption, abort, validation, stops."""

from __future__ import annotations

import pytest

from services.api.outputs import FinishReason, TokenOutput
from services.engine.batch import ScheduledBatch
from services.engine.engine import LLMEngine
from services.engine.runner.mock_runner import MockRunner
from services.engine.scheduler import InvalidRequestError
from tests.support.engine_factory import EOS, make_engine, mock_cfg, oracle, req, run_all


def step(eng: LLMEngine, runner: MockRunner) -> tuple[ScheduledBatch, list[TokenOutput]]:
    batch = eng.scheduler.schedule()
    outs = eng.scheduler.update(batch, runner.execute(batch))
    eng.check_integrity()
    return batch, outs


def shape(batch: ScheduledBatch) -> list[tuple[str, int, int, bool]]:
    return [(s.request_id, s.start_pos, len(s.token_ids), s.sample) for s in batch.seqs]


def prompt(n: int, base: int = 10) -> list[int]:
    return [base + i for i in range(n)]


def test_fifo_never_reorders_a_small_request_past_a_waiting_one() -> None:
    eng, runner, _ = make_engine(mock_cfg(max_num_batched_tokens=16))
    eng.add_request(req("r0", prompt(10, 100)))
    eng.add_request(req("r1", prompt(12, 200)))  # does not fit after r0 and r0 went first
    eng.add_request(req("r2", prompt(3, 300)))  # would fit, but must not jump ahead
    b, _ = step(eng, runner)
    assert shape(b) == [("r0", 0, 10, True)]
    b, _ = step(eng, runner)  # r0 decodes (1), then 15 left: r1 (12) and r2 (3)
    assert shape(b) == [("r0", 10, 1, True), ("r1", 0, 12, True), ("r2", 0, 3, True)]


def test_oversize_head_is_chunked_not_starved_and_samples_only_at_the_end() -> None:
    # no lone step target: with one, the small prompt would go before big's next slice
    # (test_itl_target.py)
    eng, runner, _ = make_engine(mock_cfg(max_num_batched_tokens=8).model_copy(
        update={"lone_step_target_ms": None}))
    eng.add_request(req("big", prompt(20, 100), max_tokens=2))
    eng.add_request(req("small", prompt(3, 300), max_tokens=2))
    shapes, first = [], []
    for _ in range(3):
        b, outs = step(eng, runner)
        shapes.append(shape(b))
        first += [o.token_ids[0] for o in outs if o.request_id == "small"]
    assert shapes == [
        [("big", 0, 8, False)],
        [("big", 8, 8, False)],
        [("big", 16, 4, True), ("small", 0, 3, True)],
    ]
    got = run_all(eng)
    assert first + got["small"] == oracle(eng, runner, req("small", prompt(3, 300), 2))[0]


def test_oversize_request_behind_another_is_chunked_to_what_is_left() -> None:
    eng, runner, _ = make_engine(mock_cfg(max_num_batched_tokens=8))
    eng.add_request(req("a", prompt(3, 100)))
    eng.add_request(req("b", prompt(20, 200)))
    eng.add_request(req("c", prompt(2, 300)))
    b, _ = step(eng, runner)
    assert shape(b) == [("a", 0, 3, True), ("b", 0, 5, False)]


def test_budget_counts_decode_tokens_and_decodes_are_never_starved() -> None:
    cfg = mock_cfg(max_num_batched_tokens=12, max_num_seqs=6, num_kv_blocks=256)
    eng, runner, _ = make_engine(cfg)
    eng.add_request(req("d", prompt(4, 1), max_tokens=30))
    for i in range(6):
        eng.add_request(req(f"p{i}", prompt(9 + 3 * i, 100 * (i + 1)), max_tokens=3))
    for _ in range(60):
        if not eng.has_unfinished():
            break
        decodes = {s.request_id for s in eng.scheduler.running
                   if s.num_tokens - s.num_computed_tokens == 1}
        b, _ = step(eng, runner)
        ids = [s.request_id for s in b.seqs]
        assert decodes <= set(ids)  # every decode got its token this step
        assert b.num_tokens <= cfg.max_num_batched_tokens
        if "d" in decodes:
            assert ("d", 1) in [(s.request_id, len(s.token_ids)) for s in b.seqs]
    assert not eng.has_unfinished()


def test_preemption_by_recompute_gives_the_undisturbed_output() -> None:
    # 8 blocks of 4 tokens: three 9-token prompts growing to 21 tokens cannot all fit
    cfg = mock_cfg(num_kv_blocks=8, max_num_batched_tokens=32)
    eng, runner, _ = make_engine(cfg)
    reqs = [req(f"r{i}", prompt(9, 50 * i), max_tokens=12) for i in range(3)]
    for r in reqs:
        eng.add_request(r)
    got = run_all(eng)
    assert eng.stats().num_preemptions_total > 0
    for r in reqs:
        assert got[r.request_id] == oracle(eng, runner, r)[0]
    big, big_runner, _ = make_engine(mock_cfg(num_kv_blocks=64))
    for r in reqs:
        big.add_request(req(r.request_id, r.prompt_token_ids, 12))
    assert run_all(big) == got and big.stats().num_preemptions_total == 0
    assert eng.stats().kv_blocks_used == 0


@pytest.mark.parametrize("when", ["waiting", "running", "mid_chunk"])
def test_abort_frees_every_block_at_once(when: str) -> None:
    eng, runner, _ = make_engine(mock_cfg(max_num_batched_tokens=8))
    eng.add_request(req("x", prompt(20, 7), max_tokens=8))
    steps = {"waiting": 0, "mid_chunk": 1, "running": 4}[when]
    for _ in range(steps):
        step(eng, runner)
    if when == "mid_chunk":
        assert eng.scheduler.seqs["x"].num_computed_tokens == 8
    if when == "running":
        assert eng.scheduler.seqs["x"].num_generated == 2
    used_before = eng.stats().kv_blocks_used
    out = eng.abort("x")
    assert out is not None and out.finished and out.finish_reason is FinishReason.ABORT
    assert eng.stats().kv_blocks_used == 0 and (used_before > 0) == (steps > 0)
    assert not eng.has_unfinished() and eng.abort("x") is None
    eng.check_integrity()


def test_invalid_requests_raise_typed_errors_naming_the_problem() -> None:
    eng, _, _ = make_engine(mock_cfg(num_kv_blocks=4, max_model_len=32, vocab_size=50))
    cases = [
        (req("e", []), "prompt is empty"),
        (req("l", [1] * 32), "max_model_len 32"),
        (req("k", [1] * 16), "never fit in the KV cache"),
        (req("v", [1, 50]), "token id 50"),
        (req("n", [-1, 3]), "token id -1"),
    ]
    for r, msg in cases:
        with pytest.raises(InvalidRequestError, match=msg):
            eng.validate(r)
    bad_export = req("x", [1] * 9)
    bad_export.export_kv_from_block = 3
    with pytest.raises(InvalidRequestError, match="export_kv_from_block 3"):
        eng.validate(bad_export)
    eng.add_request(req("d", [1, 2]))
    eng.validate(req("d", [3]))  # reads config only: a live id is the adder's concern
    with pytest.raises(InvalidRequestError, match="already live"):
        eng.add_request(req("d", [3]))
    with pytest.raises(InvalidRequestError, match="already live"):
        eng.begin_remote_prefill(req("d", [3]))
    assert eng.stats().num_waiting == 1
    eng.check_integrity()


def test_stop_conditions() -> None:
    eng, runner, _ = make_engine(mock_cfg(eos_probability=1.0))
    eng.add_request(req("eos", [5, 6], max_tokens=5))
    eng.add_request(req("ign", [5, 6], max_tokens=5, ignore_eos=True))
    got = run_all(eng)
    assert got == {"eos": [EOS], "ign": [EOS] * 5}

    eng, runner, _ = make_engine(mock_cfg(max_model_len=12))
    first = runner.next_token([1, 2, 3])
    eng.add_request(req("stop", [1, 2, 3], max_tokens=9, stop_token_ids=(first,)))
    eng.add_request(req("len", [4] * 8, max_tokens=100))
    outs: dict[str, TokenOutput] = {}
    got = {}
    while eng.has_unfinished():
        for o in eng.step():
            got.setdefault(o.request_id, []).extend(o.token_ids)
            outs[o.request_id] = o
    assert got["stop"] == [first] and outs["stop"].finish_reason is FinishReason.STOP
    assert len(got["len"]) == 4 and outs["len"].finish_reason is FinishReason.LENGTH
    assert got["len"] == oracle(eng, runner, req("len", [4] * 8, 100))[0]


def test_a_long_prefill_leaves_room_for_short_requests_that_wait() -> None:
    """long_prefill_token_threshold: while others wait, one long prompt takes at most the
    threshold of a step's budget, so a short request behind it starts at once; alone, it
    takes the whole budget."""
    eng, runner, _ = make_engine(mock_cfg(max_num_batched_tokens=16, long_prefill_token_threshold=8))
    eng.add_request(req("long", prompt(40, 100), max_tokens=2))
    b, _ = step(eng, runner)
    assert shape(b) == [("long", 0, 16, False)]  # alone: the whole budget
    eng.add_request(req("short", prompt(3, 300), max_tokens=2))
    b, outs = step(eng, runner)
    assert shape(b) == [("long", 16, 8, False), ("short", 0, 3, True)]
    assert [o.request_id for o in outs] == ["short"]  # its first token after one step
    b, _ = step(eng, runner)  # nobody waits: the long prompt takes what decodes leave
    assert shape(b) == [("long", 24, 15, False), ("short", 3, 1, True)]


def test_fifo_prefill_finishes_prompts_in_arrival_order() -> None:
    """engine.prefill_order fifo (a prefill worker's): two long prompts that wait together
    do not share steps until both end together; the first takes the whole budget and ends
    first, a whole prompt that fits what is left rides along, a partial slice never does."""
    cfg = mock_cfg(max_num_batched_tokens=16, long_prefill_token_threshold=8)
    eng, runner, _ = make_engine(cfg.model_copy(update={"prefill_order": "fifo"}))
    eng.add_request(req("a", prompt(24, 100), max_tokens=1))
    eng.add_request(req("b", prompt(24, 200), max_tokens=1))
    eng.add_request(req("c", prompt(4, 300), max_tokens=1))
    shapes, ends = [], []
    for _ in range(4):
        b, outs = step(eng, runner)
        shapes.append(shape(b))
        ends.append(sorted(o.request_id for o in outs))
    assert shapes == [
        [("a", 0, 16, False)],
        [("a", 16, 8, True)],  # b does not fit the 8 left whole: it waits for its own step
        [("b", 0, 16, False)],
        [("b", 16, 8, True), ("c", 0, 4, True)],  # c fits whole beside b's last slice
    ]
    assert ends == [[], ["a"], [], ["b", "c"]]
    assert not eng.has_unfinished()


def test_share_prefill_interleaves_prompts_that_fifo_finishes_one_by_one() -> None:
    """The same two prompts under each order: "share" (a decode worker's default) caps each
    slice at the threshold while the other waits, so both end in the second step; "fifo"
    ends the first a step earlier, the second no later."""
    ends: dict[str, list[list[str]]] = {}
    for order in ("share", "fifo"):
        cfg = mock_cfg(max_num_batched_tokens=16, long_prefill_token_threshold=8)
        eng, runner, _ = make_engine(cfg.model_copy(update={"prefill_order": order}))
        eng.add_request(req("a", prompt(12, 100), max_tokens=1))
        eng.add_request(req("b", prompt(12, 200), max_tokens=1))
        ends[order] = []
        while eng.has_unfinished():
            _, outs = step(eng, runner)
            ends[order].append(sorted(o.request_id for o in outs))
    assert ends == {"share": [[], ["a", "b"]], "fifo": [["a"], ["b"]]}


@pytest.mark.parametrize(("order", "prefill_worker", "fifo"), [
    ("auto", True, True), ("auto", False, False), ("share", True, False), ("fifo", False, True)])
def test_prefill_order_auto_is_fifo_on_a_prefill_worker_only(order: str, prefill_worker: bool,
                                                              fifo: bool) -> None:
    cfg = mock_cfg().model_copy(update={"prefill_order": order})
    eng = LLMEngine(MockRunner(cfg), cfg, [EOS], prefill_worker=prefill_worker)
    assert eng.scheduler.fifo_prefill is fifo
