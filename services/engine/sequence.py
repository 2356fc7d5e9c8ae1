"""One request's state inside the engine: its tokens, what is computed, its blocks."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from services.api.outputs import FinishReason, TokenLogprob
from services.api.sampling import SamplingParams
from services.common.hashing import BlockHash
from services.engine.request import GenerateRequest

if TYPE_CHECKING:
    from services.engine.grammar.state import GrammarState


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # queued for (re)admission; may hold prefix blocks after a fallback
    RUNNING = "running"  # scheduled every step until finished or preempted
    PARKED = "parked"  # blocks allocated, waiting for a remote prefill's KV
    READY = "ready"  # remote prefill imported; joins running when a seat is free
    HELD = "held"  # moving off a draining worker: blocks kept for one export, never scheduled
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """A request as the scheduler tracks it.

    ``token_ids`` is prompt + generated tokens. The KV of ``token_ids[:num_computed_tokens]``
    is in the blocks of ``block_table`` (in order), or is being written by a batch that was
    launched already: the count advances when a batch is scheduled, not when it completes.
    A token a launched batch is still sampling is a negative placeholder
    (``batch.placeholder``) until its result is read. The scheduler's target is
    ``num_tokens``: every step computes some of ``token_ids[num_computed_tokens:]`` and
    samples once all of them are computed.
    """

    request: GenerateRequest
    token_ids: list[int]
    num_prompt_tokens: int
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    # Hashes of the full blocks of token_ids computed so far (grows lazily, never stale:
    # tokens are only appended).
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_cached_blocks: int = 0  # leading blocks of block_table registered in the prefix cache
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache on first admission
    # Tokens the prefix cache held for it when it last joined the waiting queue (added or
    # preempted): a load estimate for prefill_tokens_pending; the hit at admission decides.
    num_expected_hit_tokens: int = 0
    admitted: bool = False  # counted in the engine's prompt/hit totals already
    finish_reason: FinishReason | None = None
    # Remote prefill (decode side): blocks [fill_from, len(block_table)) await an import.
    remote_fill_from: int = -1
    # The token a batch in flight samples for it reaches max_tokens or max_model_len: it
    # finishes when that result is read, so it is not scheduled again (no wasted step).
    length_capped: bool = False
    # Its grammar's matcher (structured output), advanced by each resolved token.
    grammar: GrammarState | None = None
    # Its row of the runner's token counts (logits_process.py) while penalised; -1: none.
    penalty_slot: int = -1
    # n > 1: which choice, and the request's live choices (one list, shared by all of them;
    # None for n = 1). Choice 0 forks the others once its prompt is computed.
    choice: int = 0
    group: list[Sequence] | None = None
    forked: bool = False
    # sampling.prompt_logprobs: those computed so far, prompt token i's at [i - 1].
    prompt_logprobs: list[TokenLogprob] | None = None
    # The scheduler's clock when it arrived, was first scheduled (a remote prefill: parked)
    # and produced its first token (0.0: not yet): the phases of EngineTimings.
    queued_at: float = 0.0
    scheduled_at: float = 0.0
    first_token_at: float = 0.0

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def sampling(self) -> SamplingParams:
        return self.request.sampling

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether its prompt is still to be computed for its prompt logprobs: choice 0 of a
        request that asked, before its first token (a preempted one resumes from the cache:
        its prompt logprobs went out with that token)."""
        return (self.request.sampling.prompt_logprobs is not None and self.choice == 0
                and len(self.token_ids) == self.num_prompt_tokens)

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    @classmethod
    def from_request(cls, request: GenerateRequest) -> Sequence:
        hashes = request.block_hashes
        return cls(request, list(request.prompt_token_ids), len(request.prompt_token_ids),
                   block_hashes=[] if hashes is None else list(hashes))
