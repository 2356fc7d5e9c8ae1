"""Scheduler.decode_run_length / advance_decodes (the simulator's fast path): k decode steps
at once leave the state k steps one by one leave."""

from __future__ import annotations

from services.api.kv_events import KvEvent, KvRemoved, KvStored
from services.api.sampling import SamplingParams
from services.engine.engine import LLMEngine
from services.engine.request import GenerateRequest
from services.sim.runner import SimRunner
from services.steptime.model import MockStepModel
from tests.support.engine_factory import EOS, mock_cfg

TOKEN = 7


def engine(num_kv_blocks: int = 64) -> tuple[LLMEngine, list[KvEvent]]:
    cfg = mock_cfg(num_kv_blocks=num_kv_blocks, max_num_batched_tokens=64)
    events: list[KvEvent] = []
    runner = SimRunner(cfg, MockStepModel(0, 0, 0), token=TOKEN)
    return LLMEngine(runner, cfg, [EOS], "w", events.append), events


def add(eng: LLMEngine, rid: str, n: int, max_tokens: int, base: int) -> None:
    eng.add_request(GenerateRequest(rid, [base + i for i in range(n)],
                                    SamplingParams(max_tokens=max_tokens)))


def cached(events: list[KvEvent]) -> set[int]:
    held: set[int] = set()
    for e in events:
        if isinstance(e, KvStored):
            held.update(b.seq_hash for b in e.blocks)
        elif isinstance(e, KvRemoved):
            held.difference_update(e.seq_hashes)
    return held


def state(eng: LLMEngine) -> list[tuple]:
    return [(s.request_id, list(s.token_ids), s.num_computed_tokens, s.num_cached_blocks,
             len(s.block_table), [h.seq_hash for h in s.block_hashes[:s.num_cached_blocks]])
            for s in eng.scheduler.running]


def started(num_kv_blocks: int = 64) -> tuple[LLMEngine, list[KvEvent]]:
    """Three requests past their prefill, decoding (lengths cross block boundaries apart)."""
    eng, events = engine(num_kv_blocks)
    add(eng, "a", 9, 40, 100)
    add(eng, "b", 6, 30, 200)
    add(eng, "c", 13, 50, 300)
    while any(s.num_tokens - s.num_computed_tokens != 1 for s in eng.scheduler.running) \
            or eng.scheduler.waiting:
        eng.step()
    return eng, events


def test_a_run_equals_the_steps_one_by_one() -> None:
    one, ev_one = started()
    run, ev_run = started()
    k = run.scheduler.decode_run_length(100, TOKEN)
    assert k > 5
    for _ in range(k):
        outs = one.step()
        assert all(o.token_ids == [TOKEN] and not o.finished for o in outs)
    run.scheduler.advance_decodes(k, TOKEN)
    assert state(run) == state(one)
    assert (run.pool.num_used, run.pool.num_cached, run.pool.num_free) == \
        (one.pool.num_used, one.pool.num_cached, one.pool.num_free)
    assert cached(ev_run) == cached(ev_one)
    run.check_integrity()
    # and the rest runs to the same end
    while one.has_unfinished():
        one.step()
    while run.has_unfinished():
        run.step()
    assert cached(ev_run) == cached(ev_one)


def test_a_run_stops_one_step_before_a_request_finishes() -> None:
    eng, _ = started()
    shortest = min(s.sampling.max_tokens - s.num_generated for s in eng.scheduler.running)
    k = eng.scheduler.decode_run_length(1000, TOKEN)
    assert k == shortest - 1
    eng.scheduler.advance_decodes(k, TOKEN)
    outs = eng.step()
    assert sum(o.finished for o in outs) >= 1


def test_no_run_while_a_request_waits_or_would_stop() -> None:
    eng, _ = started()
    assert eng.scheduler.decode_run_length(10, EOS) == 0  # its token would end them
    add(eng, "d", 5, 4, 400)
    assert eng.scheduler.decode_run_length(10, TOKEN) == 0


def test_a_run_never_needs_more_blocks_than_the_pool_holds() -> None:
    eng, _ = started(num_kv_blocks=20)
    free = eng.pool.num_available
    k = eng.scheduler.decode_run_length(1000, TOKEN)
    assert 0 < k
    bs = eng.scheduler.block_size
    need = sum(max(0, -(-(s.num_computed_tokens + k) // bs) - len(s.block_table))
               for s in eng.scheduler.running)
    assert need <= free
    eng.scheduler.advance_decodes(k, TOKEN)
    eng.check_integrity()


def test_a_prompt_chunked_down_to_its_last_token_is_not_a_decode() -> None:
    eng, _ = engine()
    add(eng, "a", 9, 40, 100)
    while eng.scheduler.waiting or eng.scheduler.running[0].num_tokens == 9:
        eng.step()  # "a" decodes now
    # 64 prompt tokens under a 64-token budget less a's decode: the last chunk is 1 token
    add(eng, "b", 64, 10, 500)
    eng.step()
    b = next(s for s in eng.scheduler.running if s.request_id == "b")
    assert b.num_tokens - b.num_computed_tokens == 1 and b.num_generated == 0
    assert eng.scheduler.decode_run_length(100, TOKEN) == 0  # its step makes its first token
    outs = eng.step()
    assert any(o.request_id == "b" and o.token_ids for o in outs)
    assert eng.scheduler.decode_run_length(100, TOKEN) > 0
