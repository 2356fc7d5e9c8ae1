"""The remote-prefill decision: each condition alone flips it, in the documented order."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.common.config import DisaggConfig
from services.decode.disagg import DecisionReason, decide_prefill

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
