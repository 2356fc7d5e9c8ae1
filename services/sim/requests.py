"""What a simulation replays: requests with arrival times and lengths, and the rule that
turns a trace's block ids into prompt tokens.

A request carries either its prompt tokens (our synthetic workloads, and every workload
the real-cluster bench sends, so a calibration replays exactly what the cluster served)
or, for a Mooncake trace, its ``hash_ids``: one id per ``trace_block`` tokens, equal ids
meaning an equal prefix up to that block. Tokens are made only when the request arrives
(``prompt_tokens``) and dropped when it ends: a trace-hour of 12k-token prompts would not
fit in memory as token lists.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One request of a replay.

    ``arrival_s``: seconds from the replay's start. ``after``: index of the request that
    must finish before this one is sent (a conversation's previous turn), or None; it is
    then sent at ``max(arrival_s, that request's end)``."""

    index: int
    arrival_s: float
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...] | None = None
    trace_block: int = 512
    prompt: tuple[int, ...] | None = None
    after: int | None = None
