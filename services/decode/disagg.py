"""The remote-prefill decision: a pure function of the config, the prompt, this worker's
prefix cache and the prefill queue (docs/architecture.md, "Remote prefill decision")."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from services.common.config import DisaggConfig


class DecisionReason(enum.StrEnum):
    REMOTE = "remote"  # long enough and the queue has room
    DISABLED = "disabled"  # decode.disagg.enabled is false
    SHORT = "short"  # effective prefill <= max_local_prefill_length
    QUEUE_FULL = "queue_full"  # queue holds max_prefill_queue_size requests or more
    QUEUE_TOKENS = "queue_tokens"  # queued prefill tokens + this one would exceed the bound


@dataclass(frozen=True, slots=True)
class PrefillDecision:
    remote: bool
    reason: DecisionReason
    effective_tokens: int  # prompt tokens not served by this worker's prefix cache


def decide_prefill(
    cfg: DisaggConfig,
    prompt_len: int,
    cached_tokens: int,
    queue_depth: int,
    queued_prefill_tokens: int,
) -> PrefillDecision:
    """Where to prefill one request.

    ``effective = prompt_len - cached_tokens`` (``cached_tokens`` is block-accurate: what
    this worker's prefix cache serves). Remote iff all of:

    - ``cfg.enabled``;
    - ``effective > cfg.max_local_prefill_length``;
    - ``queue_depth < cfg.max_prefill_queue_size`` (pending + unacked jobs);
    - ``queued_prefill_tokens + effective <= cfg.max_prefill_queue_tokens``.

    The first failing condition, in that order, is the reason.
    """
    if prompt_len < 0 or not 0 <= cached_tokens <= prompt_len:
        raise ValueError(f"cached_tokens {cached_tokens} must be within [0, prompt_len={prompt_len}]")
    if queue_depth < 0 or queued_prefill_tokens < 0:
        raise ValueError("queue_depth and queued_prefill_tokens must be >= 0")
    effective = prompt_len - cached_tokens
    if not cfg.enabled:
        reason = DecisionReason.DISABLED
    elif effective <= cfg.max_local_prefill_length:
        reason = DecisionReason.SHORT
    elif queue_depth >= cfg.max_prefill_queue_size:
        reason = DecisionReason.QUEUE_FULL
    elif queued_prefill_tokens + effective > cfg.max_prefill_queue_tokens:
        reason = DecisionReason.QUEUE_TOKENS
    else:
        return PrefillDecision(True, DecisionReason.REMOTE, effective)
    return PrefillDecision(False, reason, effective)
