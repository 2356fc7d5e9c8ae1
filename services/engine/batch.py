"""The contract between the scheduler and the model runner for one engine step.

The scheduler decides *what* to compute (it never touches torch); the runner computes it.
Keeping this boundary a plain data structure is what lets a later change overlap the
scheduling of step N+1 with the forward of step N.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from services.api.outputs import TokenLogprob
from services.api.sampling import SamplingParams
from services.engine.timings import StepKind
from services.steptime.model import BatchShape

if TYPE_CHECKING:
    from services.engine.grammar.batch_mask import BatchMask
    from services.engine.sequence import Sequence
    from services.model.image_spans import ImageSpan

# Future-token slots per batch region; the scheduler rotates through FUTURE_REGIONS regions
# of max_num_seqs slots. Two would do (a placeholder of batch N is resolved by the runner
# for batch N+1 and replaced on the host before batch N+2 is built); three leave a margin.
FUTURE_REGIONS = 3


def placeholder(slot: int) -> int:
    """The token id standing for the token a runner will write to future slot ``slot``."""
    return -1 - slot


@dataclass(frozen=True, slots=True)
class PenaltyInit:
    """A penalty slot's starting state (logits_process.py): the request's prompt and the
    tokens it produced already (after a migration they end its prompt)."""

    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's slice of work in a step.

    ``token_ids`` are the tokens whose KV is computed this step, at positions
    ``start_pos .. start_pos + len(token_ids) - 1``; positions before ``start_pos`` are
    already in the KV cache (or will be, by the batch launched before this one). A
    negative token id is a placeholder (``placeholder(slot)``) for a token the previous
    batch is still sampling: the runner resolves it from its future-token map right
    before the forward. ``block_ids`` is the sequence's block table (the live list: it
    only ever grows in place, and the runner reads only the blocks up to ``end_pos``).
    When ``sample`` is true the last position's logits produce the sequence's next token.
    A penalised request's ``penalty_slot`` names its token counts on the device; its first
    sampling batch carries ``penalty_init`` to fill them. ``banned_ids`` (EOS and stop
    token ids, until ``min_tokens``) cannot be sampled this step.
    ``images`` are the prompt's image spans; the runner puts their embeddings in place of
    the placeholder tokens this step computes. ``prompt_targets`` (a request with
    ``sampling.prompt_logprobs``) are the prompt tokens at positions ``start_pos + 1 ..
    start_pos + len(prompt_targets)``: the logits of this step's first
    ``len(prompt_targets)`` positions give their logprobs.
    """

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_ids: list[int]
    sample: bool
    sampling: SamplingParams
    num_generated: int = 0  # tokens generated so far; makes seeded sampling reproducible
    penalty_slot: int = -1
    penalty_init: PenaltyInit | None = None
    banned_ids: tuple[int, ...] = ()
    images: tuple[ImageSpan, ...] = ()
    prompt_targets: tuple[int, ...] = ()

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass(slots=True)
class ScheduledBatch:
    """``seqs[i]`` is the work of ``owners[i]`` (the scheduler's own record, matched by
    identity when the result comes back: an id may be reused once a request is gone).
    The ``k``-th sampling sequence (in batch order) writes its token to future slot
    ``future_base + k``."""

    seqs: list[ScheduledSeq] = field(default_factory=list)
    owners: list[Sequence] = field(default_factory=list)
    future_base: int = 0
    # The allowed tokens of its grammar-constrained sampling rows; None: no such row.
    grammar_mask: BatchMask | None = None
    num_decodes: int = 0  # seqs computing one decode token (the rest: prompt tokens)

    @property
    def kind(self) -> StepKind:
        return StepKind.of(len(self.seqs), self.num_decodes)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    def __len__(self) -> int:
        return len(self.seqs)


@dataclass(slots=True)
class RunnerOutput:
    """``sampled[i]`` is the new token of ``batch.seqs[i]``, or None where it did not sample;
    ``logprobs[i]`` its logprobs where the request asked for them (None: nobody asked);
    ``prompt_logprobs[i]`` those of its ``prompt_targets`` (None: no row had targets)."""

    sampled: list[int | None]
    logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs: list[list[TokenLogprob] | None] | None = None


class PendingOutput(Protocol):
    """A launched batch's result, read back later (the overlapped loop's one sync point)."""

    def wait(self) -> None:
        """Block until the batch has finished computing (every KV write done)."""

    def result(self) -> RunnerOutput:
        """Wait, then read the sampled tokens back to the host (idempotent)."""


class DoneOutput:
    """A result that is already on the host (a runner that computes synchronously)."""

    __slots__ = ("_out",)

    def __init__(self, out: RunnerOutput) -> None:
        self._out = out

    def wait(self) -> None:
        return None

    def result(self) -> RunnerOutput:
        return self._out


def batch_shape(batch: ScheduledBatch) -> BatchShape:
    """The shape of a scheduled batch (BatchShape's docstring):
    what the simulator's runner costs, what ``tandem sim profile`` records of each real step,
    and what the ITL target
    compares an engine's measured step with (``DeviceSpeed``)."""
    prefill_tokens = prefill_context = decode_seqs = decode_context = 0
    prefix_context = prefix_end = 0
    for s in batch.seqs:
        n = len(s.token_ids)
        end = s.start_pos + n
        if n == 1:
            decode_seqs += 1
            decode_context += end
        else:
            prefill_tokens += n
            prefill_context += n * end
            if s.start_pos:
                prefix_context += n * end
                prefix_end += end
    return BatchShape(prefill_tokens, prefill_context, decode_seqs, decode_context, prefix_context,
                      prefix_end)
