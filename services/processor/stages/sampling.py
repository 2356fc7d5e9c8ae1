"""Stage 2: the request's sampling settings checked and ``max_tokens`` resolved."""

from __future__ import annotations

from dataclasses import replace

from services.api.sampling import SamplingParams
from services.common.errors import InvalidRequest
from services.processor.stop import StopMatcher


def resolve_sampling(s: SamplingParams, prompt_len: int, vocab_size: int,
                     context_length: int) -> SamplingParams:
    """``s`` with ``max_tokens`` set; InvalidRequest for a token id outside the vocabulary.

    NOTE: a max_tokens past the context is clamped, not refused: the engine ends the request
    with finish_reason "length" at the context limit either way. Resolving it here gives
    migration a number to count down from."""
    bad = [t for t in s.stop_token_ids if t >= vocab_size]
    if bad:
        raise InvalidRequest(f"stop_token_ids: token id {bad[0]} is outside the vocabulary "
                             f"[0, {vocab_size})", param="stop_token_ids")
    bad = [t for t, _ in s.logit_bias if t >= vocab_size]
    if bad:
        raise InvalidRequest(f"logit_bias: token id {bad[0]} is outside the vocabulary "
                             f"[0, {vocab_size})", param="logit_bias")
    room = context_length - prompt_len
    return replace(s, max_tokens=room if s.max_tokens is None else min(s.max_tokens, room))


def stop_matcher(stop: tuple[str, ...]) -> StopMatcher:
    """A matcher for the request's stop strings; InvalidRequest for an empty one."""
    try:
        return StopMatcher(stop)
    except ValueError as e:
        raise InvalidRequest(str(e), param="stop") from None
