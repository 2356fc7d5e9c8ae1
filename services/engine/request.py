"""What enters and leaves the engine: sampling parameters, requests and token outputs."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling. temperature 0 is greedy; top_k 0 and top_p 1 disable them."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Seeded draws use step ``num_generated + seed_step_offset``: a request migrated with
    # its produced tokens appended to the prompt continues the same random sequence.
    seed_step_offset: int = 0

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.seed_step_offset < 0:
            raise ValueError(f"seed_step_offset must be >= 0, got {self.seed_step_offset}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


class FinishReason(str, enum.Enum):
    STOP = "stop"  # an eos / stop token was produced
    LENGTH = "length"  # max_tokens or the context length was reached
    ABORT = "abort"  # aborted by the caller


@dataclass(slots=True)
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # Prefill side of disaggregation: when set, the KV of prompt blocks
    # [export_kv_from_block, ceil(prompt_len / block_size)) is exported when the request
    # finishes (before its blocks are freed) and attached to the final TokenOutput.kv.
    export_kv_from_block: int | None = None


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
    # or the runner's device. The only torch-typed field of the engine's API.
    kv: torch.Tensor | None = None
