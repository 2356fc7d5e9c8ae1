"""How one request samples and when it stops: SamplingParams and the bounds every process
checks it against where a request enters (proto/request.proto carries it; the codec is
request_codec.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from services.api.structured import StructuredOutput
from services.api.text import lone_surrogate

# Bounds that keep a request's cost and its numbers sane whoever builds it (the HTTP API,
# a gRPC caller, a prefill job): every process builds SamplingParams where a request
# enters it, so these checks run once per process.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_TOP_K = 1 << 20
MAX_LOGIT_BIAS = 1024  # logit_bias entries
MAX_N = 16  # choices per request
MAX_TOP_LOGPROBS = 20  # OpenAI's bound for chat top_logprobs and completions logprobs
MAX_PENALTY = 2.0  # presence/frequency penalties lie in [-2, 2] (OpenAI)
MAX_BIAS = 100.0  # logit_bias values lie in [-100, 100] (OpenAI)
_INT64 = 1 << 63
_MASK64 = (1 << 64) - 1


def choice_seed(seed: int, choice: int) -> int:
    """The seed choice ``choice`` of a request seeded ``seed`` draws with: ``seed`` itself for
    choice 0 (an n=1 request's), else a splitmix64 mix of both, a signed int64. Not
    ``seed + choice``: then choice 1 of seed 7 drew choice 0 of seed 8's tokens."""
    if not choice:
        return seed
    z = ((seed & _MASK64) ^ (choice * 0xD1B54A32D192ED03)) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return z - (1 << 64) if z >= _INT64 else z
_UINT32 = 1 << 32  # what proto/request.proto carries counts and token ids in


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request samples and when it stops, from the API to the engine.

    temperature 0 is greedy; top_k 0, top_p 1 and min_p 0 disable them. ``max_tokens`` None:
    up to the context length; 0: the prompt only (computed for its ``prompt_logprobs``, the
    token drawn after it dropped). ``stop`` strings are matched on the text by the processor (the
    engine sees token ids only); ``stop_token_ids`` end the request in the engine. The
    constructor rejects a bad value with a ValueError that names the field.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    # Drop tokens whose probability is below min_p times the most likely one's (after
    # temperature), as vLLM and llama.cpp do.
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Seeded draws use step ``num_generated + seed_step_offset``: a request migrated with
    # its produced tokens appended to the prompt continues the same random sequence.
    seed_step_offset: int = 0
    # Logits processing (services/engine/logits_process.py), OpenAI's and vLLM's meaning:
    # presence/frequency penalise tokens already generated, repetition_penalty (1 = off)
    # scales the logits of tokens in the prompt or generated; ``logit_bias`` is
    # ((token id, bias), ...) sorted by id; EOS and the stop token ids are masked until
    # ``min_tokens`` tokens were produced (counting ``seed_step_offset``).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    # None: no logprobs; k >= 0: the chosen token's logprob and the k most likely tokens'.
    logprobs: int | None = None
    # The same for every prompt token after the first (from the model's raw logits): such a
    # request computes its whole prompt, never taking positions from the prefix cache, and
    # prefills on its decode worker.
    prompt_logprobs: int | None = None
    # Choices: they share the prompt's prefill and KV blocks (scheduler.py, "n choices");
    # choice i draws with choice_seed(seed, i) (choice 0 with seed itself).
    n: int = 1
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
        if not (math.isfinite(self.min_p) and 0 <= self.min_p <= 1):
            raise ValueError(f"min_p: must be in [0, 1] (0 = off), got {self.min_p}")
        if self.max_tokens is not None and not 0 <= self.max_tokens < _UINT32:
            raise ValueError(f"max_tokens: must be in [0, 2^32), got {self.max_tokens}")
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
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (math.isfinite(v) and -MAX_PENALTY <= v <= MAX_PENALTY):
                raise ValueError(f"{name}: must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {v}")
        if not (math.isfinite(self.repetition_penalty) and 0 < self.repetition_penalty <= 1e3):
            raise ValueError(f"repetition_penalty: must be in (0, 1000] (1 = off), "
                             f"got {self.repetition_penalty}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
        ids = [t for t, _ in self.logit_bias]
        if any(not 0 <= t < _UINT32 for t in ids):
            raise ValueError("logit_bias: token ids must be in [0, 2^32)")
        if ids != sorted(set(ids)):
            raise ValueError("logit_bias: token ids must be unique and sorted")
        if any(not (math.isfinite(b) and -MAX_BIAS <= b <= MAX_BIAS) for _, b in self.logit_bias):
            raise ValueError(f"logit_bias: biases must be in [-{MAX_BIAS:g}, {MAX_BIAS:g}]")
        if not 0 <= self.min_tokens < _UINT32:
            raise ValueError(f"min_tokens: must be in [0, 2^32), got {self.min_tokens}")
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n: must be in [1, {MAX_N}], got {self.n}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs: must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"prompt_logprobs: must be in [0, {MAX_TOP_LOGPROBS}], "
                             f"got {self.prompt_logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def for_choice(self, i: int) -> SamplingParams:
        """Choice ``i``'s own sampling: n = 1, and if seeded, ``choice_seed(seed, i)``: its
        draws keyed by (seed, choice, position), not those of any other request's seed."""
        seed = self.seed
        if seed is not None:
            seed = choice_seed(seed, i)
        return replace(self, n=1, seed=seed)

    @property
    def penalized(self) -> bool:
        """Whether sampling needs the request's token history (counts kept on the device)."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)

    @property
    def processes_logits(self) -> bool:
        """Whether any logits rule of logits_process.py applies to this request."""
        return self.penalized or bool(self.logit_bias) or self.min_tokens > 0
