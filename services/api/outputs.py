"""What a worker streams back for a request: token outputs with their logprobs, why a
request finished and its token counts (proto/worker.proto's GenerateResponse,
proto/request.proto's FinishReason and Usage; codecs: worker_codec.py, request_codec.py)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class FinishReason(enum.StrEnum):
    STOP = "stop"  # eos, a stop token id, or (in the processor) a stop string
    LENGTH = "length"  # max_tokens or the context length was reached
    ABORT = "abort"  # aborted by the caller
    ERROR = "error"  # the request failed (its grammar refused a token); TokenOutput.error says why


@dataclass(frozen=True, slots=True)
class Usage:
    """A finished request's token counts, as the API reports them."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens served from the prefix cache

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One sampled token's log-probability and the ``k`` most likely tokens' (descending),
    from the logits the sampler used (after penalties and bias, before temperature)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(slots=True)
class TokenOutput:
    """New tokens of one request from one engine step (usually one token)."""

    request_id: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # Only with GenerateRequest.export_kv_from_block, on the final output:
    # (layers, 2, n_blocks, block_size, kv_heads, head_dim), the runner's KV dtype, on CPU
    # or the runner's device. The only torch-typed field here; it never goes on the wire as
    # is (worker_codec.py drops it; the prefill worker streams it over KvTransfer).
    kv: torch.Tensor | None = None
    error: str | None = None  # with FinishReason.ERROR: what failed, naming the request
    # One per token of token_ids when the request asked for logprobs, else None.
    logprobs: list[TokenLogprob] | None = None
    # Which of the request's ``sampling.n`` choices; ``finished`` is that choice's end.
    index: int = 0
    # With sampling.prompt_logprobs, on the request's first output (choice 0): prompt
    # token i's (i >= 1) given the tokens before it, at [i - 1].
    prompt_logprobs: list[TokenLogprob] | None = None
