"""LLMEngine + MockRunner against the brute-force oracle: prefix reuse, events, and a
property test over random request mixes (shared prefixes, aborts, tiny pools, small budgets)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.api.kv_events import KvStored
from services.api.outputs import FinishReason, TokenOutput
from tests.support.engine_factory import make_engine, mock_cfg, oracle, replay, req, run_all


def test_prefix_hits_across_requests_are_block_accurate_and_counted() -> None:
    eng, runner, events = make_engine(mock_cfg(block_size=4))
    base = list(range(100, 112))  # 3 full blocks
    eng.add_request(req("a", base, max_tokens=3))
    assert run_all(eng)["a"] == oracle(eng, runner, req("a", base, 3))[0]
    stored = [e for e in events if isinstance(e, KvStored)]
    assert [len(e.blocks) for e in stored] == [3]  # the prompt's 3 full blocks at once
    assert stored[0].parent_seq_hash is None and [e.event_id for e in events] == [1]
    # shares 2 blocks, then differs
    b = base[:8] + [7, 7, 7, 7, 7]
    assert eng.prefix_hit_tokens(b) == 8
    eng.add_request(req("b", b, max_tokens=2))
    outs: list[TokenOutput] = []
    while eng.has_unfinished():
        outs += eng.step()
    assert outs[0].num_cached_tokens == 8 and outs[0].num_prompt_tokens == 13
    assert [t for o in outs for t in o.token_ids] == oracle(eng, runner, req("b", b, 2))[0]
    new = [e for e in events[1:] if isinstance(e, KvStored)]
    assert new[0].parent_seq_hash == stored[0].blocks[1].seq_hash  # chained after the hit
    # an identical prompt never counts its last token as cached: 8 of 12, not 12
    assert eng.prefix_hit_tokens(base) == 8
    st_ = eng.stats()
    assert (st_.prompt_tokens_total, st_.prefix_cache_hit_tokens_total) == (25, 8)
    assert st_.kv_blocks_used == 0 and st_.kv_blocks_cached > 0
    assert [e.event_id for e in events] == list(range(1, len(events) + 1))
    eng.check_integrity()


def test_generated_tokens_fill_blocks_that_later_prompts_hit() -> None:
    eng, runner, _ = make_engine(mock_cfg(block_size=4))
    p = [1, 2, 3, 4, 5, 6]
    eng.add_request(req("a", p, max_tokens=6))
    gen = run_all(eng)["a"]
    convo = p + gen + [9, 9, 9]  # a follow-up turn: 15 tokens, 11 computed before
    assert eng.prefix_hit_tokens(convo) == 8  # tokens 0..7 include generated ones
    eng.add_request(req("b", convo, max_tokens=3))
    assert run_all(eng)["b"] == oracle(eng, runner, req("b", convo, 3))[0]


def test_prefill_tokens_pending_leaves_out_prefix_cache_hits() -> None:
    eng, _, _ = make_engine(mock_cfg(block_size=4, max_num_batched_tokens=8))
    base = list(range(100, 120))  # 5 full blocks
    eng.add_request(req("a", base, max_tokens=1))
    run_all(eng)  # a's blocks stay in the prefix cache
    assert eng.stats().num_prefill_tokens_pending == 0
    b = base[:16] + [7] * 6  # 22 tokens: 4 cached blocks, then its own 6 tokens
    eng.add_request(req("b", b, max_tokens=20))
    assert eng.stats().num_prefill_tokens_pending == 22 - 16
    eng.add_request(req("c", list(range(300, 310)), max_tokens=20))  # nothing cached: all 10
    assert eng.stats().num_prefill_tokens_pending == 6 + 10
    eng.step()  # b's 6 uncached tokens, then 2 of c's (an 8-token budget)
    assert eng.stats().num_prefill_tokens_pending == 8
    assert eng.stats().prefix_cache_hit_tokens_total == 16
    seen = [8]
    for _ in range(4):
        eng.step()
        seen.append(eng.stats().num_prefill_tokens_pending)
    assert seen[-1] == 0 and all(x >= y for x, y in zip(seen, seen[1:], strict=False))
    assert eng.stats().num_running == 2  # both decode: prefilled, nothing pending


def test_decode_tokens_left_counts_max_tokens_less_generated_and_requests_without_one() -> None:
    # serial steps: one step() call, one token (the overlapped loop reads a prefill back first)
    eng, _, _ = make_engine(mock_cfg(block_size=4, max_num_batched_tokens=64).model_copy(
        update={"overlap": False}))
    eng.add_request(req("a", list(range(1, 9)), max_tokens=10))
    eng.add_request(req("b", list(range(20, 30)), max_tokens=None))
    st_ = eng.stats()
    assert (st_.decode_tokens_left, st_.num_running_unbounded) == (0, 0)  # nothing running yet
    eng.step()  # both prompts, one token each
    st_ = eng.stats()
    assert (st_.decode_tokens_left, st_.num_running_unbounded) == (10 - 1, 1)
    for _ in range(3):
        eng.step()
    assert eng.stats().decode_tokens_left == 10 - 4
    eng.abort("b")
    assert eng.stats().num_running_unbounded == 0


def test_prefill_tokens_pending_after_preemption_counts_what_is_left_to_recompute() -> None:
    # 8 blocks of 4 tokens: three 9-token prompts growing to 21 tokens cannot all fit
    eng, _, _ = make_engine(mock_cfg(num_kv_blocks=8, max_num_batched_tokens=32))
    for i in range(3):
        eng.add_request(req(f"r{i}", [50 * i + k for k in range(1, 10)], max_tokens=12))
    checked = 0
    while eng.has_unfinished():
        before = eng.stats().num_preemptions_total
        eng.step()
        s = eng.scheduler
        if eng.stats().num_preemptions_total == before or not s.waiting:
            continue
        # a preempted sequence recomputes only what the cache no longer holds
        want = sum(q.num_tokens - eng.prefix_hit_tokens(q.token_ids) for q in s.waiting)
        want += sum(q.num_tokens - q.num_computed_tokens for q in s.running
                    if q.num_computed_tokens < q.num_prompt_tokens
                    or q.num_tokens - q.num_computed_tokens > 1)
        assert eng.stats().num_prefill_tokens_pending == want
        checked += 1
    assert checked > 0 and eng.stats().num_prefill_tokens_pending == 0


# ---- property test against the oracle ------------------------------------------------

@st.composite
def scenario(draw: st.DrawFn) -> dict:
    bs = draw(st.sampled_from([2, 4]))
    max_prompt = 22
    min_blocks = -(-(max_prompt + 2) // bs)  # the longest prompt must fit alone
    num_blocks = draw(st.integers(min_blocks, min_blocks + 8))
    cfg = mock_cfg(
        block_size=bs, num_kv_blocks=num_blocks,
        max_num_seqs=draw(st.integers(1, 5)),
        max_num_batched_tokens=draw(st.integers(bs, 24)),
        vocab_size=50, eos_probability=draw(st.sampled_from([0.0, 0.1])),
    )
    prefixes = [draw(st.lists(st.integers(0, 49), min_size=0, max_size=12)) for _ in range(2)]
    n = draw(st.integers(2, 8))
    reqs = []
    for i in range(n):
        pre = prefixes[draw(st.integers(0, 1))]
        suffix = draw(st.lists(st.integers(0, 49), min_size=1, max_size=max_prompt - len(pre)))
        arrive = draw(st.integers(0, 3))
        abort_at = draw(st.sampled_from([None, None, None, 0, 1, 3, 6, 10]))
        reqs.append((f"r{i}", pre + suffix, draw(st.integers(1, 20)), arrive, abort_at))
    return {"cfg": cfg, "reqs": reqs}


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario())
def test_random_mixes_match_the_oracle(sc: dict) -> None:
    eng, runner, events = make_engine(sc["cfg"])
    got: dict[str, list[int]] = {}
    reasons: dict[str, FinishReason] = {}
    aborted: set[str] = set()
    step = 0
    pending = list(sc["reqs"])
    while pending or eng.has_unfinished():
        for rid, prompt, max_tokens, arrive, abort_at in list(pending):
            if arrive <= step:
                eng.add_request(req(rid, prompt, max_tokens))
                pending.remove((rid, prompt, max_tokens, arrive, abort_at))
        for rid, _, _, arrive, abort_at in sc["reqs"]:
            if abort_at is not None and arrive + abort_at == step:
                out = eng.abort(rid)
                if out is not None:
                    aborted.add(rid)
                    eng.check_integrity()
        for o in eng.step():
            got.setdefault(o.request_id, []).extend(o.token_ids)
            if o.finished:
                assert o.finish_reason is not None
                reasons[o.request_id] = o.finish_reason
        eng.check_integrity()
        step += 1
        assert step < 2000, "engine made no progress"
    for rid, prompt, max_tokens, _, _ in sc["reqs"]:
        if rid in aborted:
            continue
        want, reason = oracle(eng, runner, req(rid, prompt, max_tokens))
        assert got[rid] == want, rid
        assert reasons[rid] is reason
    st_ = eng.stats()
    assert st_.kv_blocks_used == 0 and st_.num_running == st_.num_waiting == 0
    assert st_.kv_blocks_free + st_.kv_blocks_cached == st_.kv_blocks_total
    eng.check_integrity()
    # the event stream and a fresh dump describe the same cache
    assert replay(events) == replay(eng.dump_kv_events())
    assert [e.event_id for e in events] == list(range(1, len(events) + 1))


def test_prefill_tokens_pending_counts_uncomputed_prompt_tokens_only() -> None:
    eng, _, _ = make_engine(mock_cfg(block_size=4, max_num_batched_tokens=8))
    assert eng.stats().num_prefill_tokens_pending == 0
    eng.add_request(req("a", list(range(1, 21)), max_tokens=50))  # 20 prompt tokens
    eng.add_request(req("b", list(range(30, 40)), max_tokens=50))  # 10
    assert eng.stats().num_prefill_tokens_pending == 30
    eng.step()  # one 8-token budget, all of it prefill (nothing decodes yet)
    assert eng.stats().num_prefill_tokens_pending == 22
    # a parked remote prefill is another worker's work: not counted
    assert eng.begin_remote_prefill(req("r", list(range(50, 90)), max_tokens=2)) is not None
    assert eng.stats().num_prefill_tokens_pending == 22
    seen = [22]
    for _ in range(10):
        eng.step()
        seen.append(eng.stats().num_prefill_tokens_pending)
    assert seen[-1] == 0 and all(x >= y for x, y in zip(seen, seen[1:], strict=False))
    assert eng.stats().num_running == 2  # both decode now: their last token is not prefill
