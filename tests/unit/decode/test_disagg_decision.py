"""The remote-prefill decision: each condition alone flips it, in the documented order."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.common.config import DisaggConfig
from services.decode.disagg import DecisionReason, WorkerTimes, decide_prefill
from services.steptime.model import MockStepModel
from services.steptime.predict import prefill_seconds

CFG = DisaggConfig(enabled=True, max_local_prefill_length=100, max_prefill_queue_size=2,
                   max_prefill_queue_tokens=1000)


def test_remote_when_long_uncached_and_queue_has_room() -> None:
    d = decide_prefill(CFG, prompt_len=300, cached_tokens=96, queue_depth=1, queued_prefill_tokens=500)
    assert d.remote and d.reason is DecisionReason.REMOTE and d.effective_tokens == 204


@pytest.mark.parametrize(("kw", "reason"), [
    ({"cached_tokens": 200}, DecisionReason.SHORT),  # effective 100 is not > 100
    ({"queue_depth": 2}, DecisionReason.QUEUE_FULL),
    ({"queued_prefill_tokens": 801}, DecisionReason.QUEUE_TOKENS),  # 801 + 200 > 1000
])
def test_each_bound_sends_it_local(kw: dict, reason: DecisionReason) -> None:
    args = {"prompt_len": 300, "cached_tokens": 100, "queue_depth": 0, "queued_prefill_tokens": 0, **kw}
    d = decide_prefill(CFG, **args)
    assert not d.remote and d.reason is reason


def test_exactly_at_the_token_bound_is_still_remote() -> None:
    assert decide_prefill(CFG, 300, 100, 0, 800).remote  # 800 + 200 == 1000


def test_disabled_wins_over_everything() -> None:
    off = CFG.model_copy(update={"enabled": False})
    d = decide_prefill(off, 10_000, 0, 0, 0)
    assert not d.remote and d.reason is DecisionReason.DISABLED


def test_bad_inputs_are_errors() -> None:
    with pytest.raises(ValueError, match="cached_tokens"):
        decide_prefill(CFG, 10, 11, 0, 0)
    with pytest.raises(ValueError, match="queue_depth"):
        decide_prefill(CFG, 10, 0, -1, 0)


@given(st.integers(0, 5000), st.integers(0, 5000), st.integers(0, 10), st.integers(0, 3000))
def test_matches_the_formula(n: int, cached: int, depth: int, qtok: int) -> None:
    cached = min(cached, n)
    eff = n - cached
    want = eff > 100 and depth < 2 and qtok + eff <= 1000
    assert decide_prefill(CFG, n, cached, depth, qtok).remote is want


# ---- the predict policy: times from a step model ----------------------------------------
MODEL = MockStepModel(step_base_s=0.01, per_prefill_token_s=1e-4, per_decode_seq_s=1e-3)
# itl_weight 0: the request's own TTFT alone (the running streams' delay: its own test)
PREDICT = CFG.model_copy(update={"max_prefill_queue_size": 100, "max_prefill_queue_tokens": 10**6,
                                 "itl_weight": 0.0})


def times(pending: int = 0, running: int = 0, prefill_workers: int = 1,
          kv_s_per_token: float = 1e-6) -> WorkerTimes:
    return WorkerTimes(MODEL, 512, pending, running, running * 500, prefill_workers, kv_s_per_token)


def test_a_busy_worker_sends_a_long_prompt_to_an_idle_queue() -> None:
    d = decide_prefill(PREDICT, 2000, 0, 0, 0, times(pending=8000, running=8))
    assert d.remote and d.reason is DecisionReason.REMOTE_FASTER
    assert d.remote_s < d.local_s
    # the remote estimate: its prefill + the KV's transfer (an empty queue)
    assert d.remote_s == pytest.approx(prefill_seconds(MODEL, 2000, 512) + 0.002 + 2000 * 1e-6)


def test_an_idle_worker_keeps_a_prompt_a_deep_queue_would_delay() -> None:
    d = decide_prefill(PREDICT, 2000, 0, 5, 9000, times())
    assert not d.remote and d.reason is DecisionReason.LOCAL_FASTER
    assert d.local_s == pytest.approx(prefill_seconds(MODEL, 2000, 512))
    assert d.local_s < d.remote_s
    # more prefill workers drain the same queue sooner
    assert decide_prefill(PREDICT, 2000, 0, 5, 9000, times(prefill_workers=8)).remote_s < d.remote_s


def test_a_slow_link_keeps_it_local() -> None:
    assert decide_prefill(PREDICT, 2000, 0, 0, 0, times(pending=3000, running=4)).remote
    slow = times(pending=3000, running=4, kv_s_per_token=1e-3)
    assert not decide_prefill(PREDICT, 2000, 0, 0, 0, slow).remote


def test_a_chunk_that_breaks_the_itl_target_goes_remote_though_local_is_sooner() -> None:
    # decode step with 8 streams: 18 ms; with a 512-token chunk: 69 ms
    slow_queue = (5, 9000)
    free = decide_prefill(PREDICT, 2000, 0, *slow_queue, times(running=8))
    assert not free.remote
    strict = PREDICT.model_copy(update={"itl_target_ms": 50.0})
    d = decide_prefill(strict, 2000, 0, *slow_queue, times(running=8))
    assert d.remote and d.reason is DecisionReason.ITL_TARGET
    # a target no decode step meets cannot be kept either way: the faster path wins
    hopeless = PREDICT.model_copy(update={"itl_target_ms": 5.0})
    assert not decide_prefill(hopeless, 2000, 0, *slow_queue, times(running=8)).remote


def test_the_predict_policy_keeps_the_bounds_and_needs_prefill_workers() -> None:
    assert decide_prefill(PREDICT, 50, 0, 0, 0, times(pending=10**5)).reason is DecisionReason.SHORT
    full = PREDICT.model_copy(update={"max_prefill_queue_size": 2})
    assert decide_prefill(full, 2000, 0, 2, 0, times(pending=10**5)).reason is DecisionReason.QUEUE_FULL
    d = decide_prefill(PREDICT, 2000, 0, 0, 0, times(pending=10**5, prefill_workers=0))
    assert not d.remote and d.reason is DecisionReason.NO_PREFILL_WORKERS
    threshold = PREDICT.model_copy(update={"policy": "threshold"})
    assert decide_prefill(threshold, 2000, 0, 5, 9000, times()).reason is DecisionReason.REMOTE


def test_the_delay_a_local_prefill_adds_to_running_streams_counts_against_it() -> None:
    slow_queue = (5, 9000)  # remote is ~2x slower for the request itself
    alone = decide_prefill(PREDICT, 2000, 0, *slow_queue, times(running=8))
    assert not alone.remote
    weighted = PREDICT.model_copy(update={"itl_weight": 1.0})
    d = decide_prefill(weighted, 2000, 0, *slow_queue, times(running=8))
    # + 8 streams x the 2000 tokens' compute (0.2 s) each, beside the request's own time
    assert d.local_s == pytest.approx(alone.local_s)
    assert d.itl_cost_s == pytest.approx(8 * 2000 * 1e-4) and alone.itl_cost_s == 0
    assert d.remote and d.reason is DecisionReason.REMOTE_FASTER
    # no running streams: nobody is delayed, the request's own time decides
    assert not decide_prefill(weighted, 2000, 0, *slow_queue, times(running=0)).remote


def test_each_side_is_scaled_by_what_the_worker_measured_there() -> None:
    """WorkerTimes.local_bias / remote_bias: measured over predicted seconds to the first
    token on each side (the decode worker's moving average); a side that ran slow before
    is predicted slower, and the choice follows."""
    base = decide_prefill(PREDICT, 2000, 0, 0, 0, times(pending=3000, running=4))
    assert base.remote
    slow_remote = replace(times(pending=3000, running=4), remote_bias=3.0)
    d = decide_prefill(PREDICT, 2000, 0, 0, 0, slow_remote)
    assert d.remote_s == pytest.approx(3 * base.remote_s) and d.local_s == pytest.approx(base.local_s)
    assert not d.remote and d.reason is DecisionReason.LOCAL_FASTER
    slow_local = replace(times(), local_bias=2.0)
    free = decide_prefill(PREDICT, 2000, 0, 5, 9000, times())
    assert decide_prefill(PREDICT, 2000, 0, 5, 9000, slow_local).local_s == pytest.approx(2 * free.local_s)


def test_the_wait_a_local_prefill_makes_arrivals_sit_out_counts_against_it() -> None:
    """arrival_weight x the arrival rate x the prefill's own time of arrivals, each waiting
    half of it: an idle prefill worker a little slower for the request itself (its link)
    takes the prompt once requests keep coming, and not when none do."""
    link = 1e-5  # 0.2 s to move 20,000 tokens' KV: remote ~2.6 s against ~2.4 s local
    quiet = decide_prefill(PREDICT, 20000, 0, 0, 0, times(kv_s_per_token=link))
    assert not quiet.remote and quiet.wait_cost_s == 0
    busy = decide_prefill(PREDICT, 20000, 0, 0, 0, replace(times(kv_s_per_token=link), arrival_rate=1.0))
    own = prefill_seconds(MODEL, 20000, 512)
    assert busy.wait_cost_s == pytest.approx(0.25 * 1.0 * own * own / 2)
    assert busy.local_s == pytest.approx(quiet.local_s) and busy.remote_s == pytest.approx(quiet.remote_s)
    assert busy.remote and busy.reason is DecisionReason.REMOTE_FASTER
    # only this prefill's own time is priced, not the prompts already waiting here
    waiting = decide_prefill(PREDICT, 20000, 0, 0, 0,
                             replace(times(pending=4000, kv_s_per_token=link), arrival_rate=1.0))
    assert waiting.wait_cost_s == pytest.approx(busy.wait_cost_s)
    off = PREDICT.model_copy(update={"arrival_weight": 0.0})
    assert not decide_prefill(off, 20000, 0, 0, 0,
                              replace(times(kv_s_per_token=link), arrival_rate=1.0)).remote
