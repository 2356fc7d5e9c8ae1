"""What one worker of each role can do, from the step-time model (services/steptime): the
figures the formula sizes with and the lookahead runs on. One place, so both read the
device the same way the router's and the decode worker's predictions do."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import ClusterConfig
from services.steptime.model import BatchShape, StepModel
from services.steptime.predict import prefill_seconds


@dataclass(frozen=True, slots=True)
class Capacity:
    model: StepModel
    chunk: int  # engine.max_num_batched_tokens: tokens of prompt per step
    block_size: int
    kv_blocks: int  # per decode worker
    max_seqs: int  # per decode worker
    max_local_prefill: int  # decode.disagg.max_local_prefill_length (0: disagg off)

    @classmethod
    def of(cls, cfg: ClusterConfig, model: StepModel) -> Capacity:
        e, d = cfg.engine, cfg.decode.disagg
        return cls(model, e.max_num_batched_tokens, e.block_size, e.num_kv_blocks,
                   e.max_num_seqs, d.max_local_prefill_length if d.enabled else 1 << 30)

    def remote(self, input_tokens: float) -> bool:
        """Whether a prompt this long is prefilled by a prefill worker (the decode worker's
        length rule; its queue-depth and predicted-time rules are left out)."""
        return input_tokens > self.max_local_prefill

    def prefill_s_per_token(self, input_tokens: float) -> float:
        """Seconds per prompt token, prefilling prompts of this length alone."""
        n = max(1, round(input_tokens))
        return prefill_seconds(self.model, n, self.chunk) / n

    def prefill_tok_s(self, input_tokens: float) -> float:
        """Prompt tokens per second one busy prefill worker computes."""
        return 1.0 / self.prefill_s_per_token(input_tokens)

    def decode_step_s(self, batch: float, context: float) -> float:
        """One decode step of ``batch`` sequences of ``context`` tokens each."""
        b = max(1, round(batch))
        return self.model.step_seconds(BatchShape(0, 0, b, round(b * context)))

    def chunk_gap_s(self, batch: float, context: float, input_tokens: float) -> float:
        """A decode step that carries a local prefill's chunk: the gap the decodes beside it
        see (what a request's largest inter-token gap, the goodput rule's ITL, is made of)."""
        n = max(1, round(min(input_tokens, self.chunk)))
        b = max(0, round(batch))
        return self.model.step_seconds(BatchShape(n, n * n, b, round(b * context)))

    def blocks(self, tokens: float) -> int:
        return -(-max(1, round(tokens)) // self.block_size)
