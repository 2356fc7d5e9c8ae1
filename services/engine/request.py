"""What enters and leaves the engine: sampling parameters, requests and token outputs."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from services.common.text import lone_surrogate
from services.engine.grammar.spec import StructuredOutput

if TYPE_CHECKING:
    import torch

    from services.engine.multimodal.spans import ImageSpan


# Bounds that keep a request's cost and its numbers sane whoever builds it (the HTTP API,
# a gRPC caller, a prefill job): every process builds SamplingParams where a request
# enters it, so these checks run once per process.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_TOP_K = 1 << 20
_INT64 = 1 << 63
_UINT32 = 1 << 32  # what proto/request.proto carries counts and token ids in


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request samples and when it stops, from the API to the engine.

    temperature 0 is greedy; top_k 0 and top_p 1 disable them. ``max_tokens`` None: up to
    the context length. ``stop`` strings are matched on the text by the processor (the
    engine sees token ids only); ``stop_token_ids`` end the request in the engine. The
    constructor rejects a bad value with a ValueError that names the field.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Seeded draws use step ``num_generated + seed_step_offset``: a request migrated with
    # its produced tokens appended to the prompt continues the same random sequence.
    seed_step_offset: int = 0
    # Constrained decoding: what the generated text must match (engine/grammar). A migrated
    # request's matcher replays the last ``seed_step_offset`` prompt tokens (produced before).
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature: must be a finite number >= 0, got {self.temperature}")
        if not 0 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k: must be in [0, {MAX_TOP_K}] (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not -_INT64 <= self.seed < _INT64:
            raise ValueError(f"seed: must fit in a signed 64-bit integer, got {self.seed}")
        if self.max_tokens is not None and not 1 <= self.max_tokens < _UINT32:
            raise ValueError(f"max_tokens: must be in [1, 2^32), got {self.max_tokens}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not s or len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(f"stop: stop strings must have 1 to {MAX_STOP_STRING_CHARS} "
                                 f"characters, got {len(s)}")
            if lone_surrogate(s) is not None:
                raise ValueError("stop: a stop string holds a lone UTF-16 surrogate, "
                                 "which is not valid Unicode")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS}, "
                             f"got {len(self.stop_token_ids)}")
        if any(not 0 <= t < _UINT32 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids: token ids must be in [0, 2^32)")
        if not 0 <= self.seed_step_offset < _UINT32:
            raise ValueError(f"seed_step_offset: must be in [0, 2^32), got {self.seed_step_offset}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


class FinishReason(str, enum.Enum):
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


@dataclass(slots=True)
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # Prefill side of disaggregation: when set, the KV of prompt blocks
    # [export_kv_from_block, ceil(prompt_len / block_size)) is exported when the request
    # finishes (before its blocks are freed) and attached to the final TokenOutput.kv.
    export_kv_from_block: int | None = None
    # A multimodal prompt's images: their placeholder positions, content hashes (part of
    # the prefix-cache block hashes) and embeddings (set before the request is added).
    images: tuple[ImageSpan, ...] = ()


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
    error: str | None = None  # with FinishReason.ERROR: what failed, naming the request
