"""The contract between the scheduler and the model runner for one engine step.

The scheduler decides *what* to compute (it never touches torch); the runner computes it.
Keeping this boundary a plain data structure is what lets a later change overlap the
scheduling of step N+1 with the forward of step N.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.engine.request import SamplingParams


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's slice of work in a step.

    ``token_ids`` are the tokens whose KV is computed this step, at positions
    ``start_pos .. start_pos + len(token_ids) - 1``; positions before ``start_pos`` are
    already in the KV cache. ``block_ids`` is the sequence's whole block table and covers
    every position up to the last one computed now. When ``sample`` is true the last
    position's logits produce the sequence's next token.
    """

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_ids: list[int]
    sample: bool
    sampling: SamplingParams
    num_generated: int = 0  # tokens generated so far; makes seeded sampling reproducible

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[ScheduledSeq] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    def __len__(self) -> int:
        return len(self.seqs)


@dataclass(slots=True)
class RunnerOutput:
    """``sampled[i]`` is the new token of ``batch.seqs[i]``, or None where it did not sample."""

    sampled: list[int | None]
