"""Step-time models: how long one engine step takes, from the shape of its batch.

The simulator's runner computes no model; it asks a ``StepModel`` how long the batch it
was given would take on the modelled device. Two kinds:

- ``MockStepModel``: the mock runner's own cost (``engine.mock``), so a simulation and a
  ``tandem up --set engine.runner=mock`` cluster model the same device;
- a fitted profile of the real engine (``services.steptime.profile``, written by
  ``tandem sim profile``), named by ``engine.step_model: PATH``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

from services.common.config import MockRunnerConfig


@dataclass(frozen=True, slots=True)
class BatchShape:
    """What a step computes. A one-token slice counts as a decode (as the mock runner
    counts it); every longer slice is prefill.

    ``prefill_tokens``: tokens of the prefill slices; ``prefill_context``: the sum over
    prefill slices of ``tokens * end_pos`` (their attention work); ``decode_seqs``: the
    decode slices; ``decode_context``: the sum of their ``end_pos`` (the KV they read);
    ``prefill_prefix_context``: the part of ``prefill_context`` from slices that start
    after a computed prefix (a prefix-cache hit or an earlier chunk), and
    ``prefill_prefix_end``: the sum of those slices' ``end_pos``. Such a slice gathers its
    cached KV through the block table (work by ``end_pos``) and attends under a mask,
    several times a fresh prompt's causal attention per unit of work on a CPU."""

    prefill_tokens: int = 0
    prefill_context: int = 0
    decode_seqs: int = 0
    decode_context: int = 0
    prefill_prefix_context: int = 0
    prefill_prefix_end: int = 0

    @property
    def num_seqs(self) -> int:
        return self.decode_seqs + (1 if self.prefill_tokens else 0)


class StepModel(Protocol):
    """Seconds one step of a batch of this shape takes on the modelled device.

    ``reads_decode_context``: whether ``decode_context`` changes the answer (when it does not,
    a run of decode steps of one batch costs the same every step: computed once).
    ``overlap_pays``: whether the modelled runner's overlapped loop is on under
    ``engine.overlap: auto`` (it then composes each batch while the one before computes).
    ``row_tokens``: steps with this many prefill tokens or fewer are costed as the runner's
    row steps, apart from the longer ones (0: one cost for every step with prefill)."""

    reads_decode_context: bool
    overlap_pays: bool
    row_tokens: int

    def step_seconds(self, shape: BatchShape) -> float: ...

    def steps_seconds(self, total: BatchShape, steps: int) -> float:
        """Seconds of ``steps`` prefill steps whose shapes add up to ``total``: exact for the
        models here, which are linear in the shape's fields (what the router's and the decode
        worker's predictions need in O(1), not one call per chunk)."""
        ...


def holds_rows(total: BatchShape, steps: int, row_tokens: int) -> bool:
    """Whether ``steps`` prefill steps adding up to ``total`` are row steps: each holds
    ``row_tokens`` prefill tokens or fewer (``total`` spread evenly over them)."""
    return 0 < total.prefill_tokens <= row_tokens * steps


@dataclass(frozen=True, slots=True)
class MockStepModel:
    """``step_base_s + per_prefill_token_s * prefill_tokens + per_decode_seq_s * decode_seqs``:
    the mock runner's device (services/engine/runner/mock_runner.py)."""

    step_base_s: float
    per_prefill_token_s: float
    per_decode_seq_s: float
    reads_decode_context: ClassVar[bool] = False
    overlap_pays: ClassVar[bool] = True  # as MockRunner's
    row_tokens: ClassVar[int] = 0

    @classmethod
    def of(cls, cfg: MockRunnerConfig) -> MockStepModel:
        return cls(cfg.step_base_s, cfg.per_prefill_token_s, cfg.per_decode_seq_s)

    def step_seconds(self, shape: BatchShape) -> float:
        return (self.step_base_s + self.per_prefill_token_s * shape.prefill_tokens
                + self.per_decode_seq_s * shape.decode_seqs)

    def steps_seconds(self, total: BatchShape, steps: int) -> float:
        return (self.step_base_s * steps + self.per_prefill_token_s * total.prefill_tokens
                + self.per_decode_seq_s * total.decode_seqs)


@dataclass(frozen=True, slots=True)
class ScaledStepModel:
    """``base`` run at measured speeds: each step's modelled seconds times the ratio its
    fit ran at (measured / modelled, as an engine's ``DeviceSpeed`` sums them): ``decode``
    for decode-only steps, ``rows`` for steps with up to ``row_tokens`` prefill tokens (the
    CPU's one-call step), ``prefill`` for the longer ones. ``tandem sim calibrate`` runs the
    simulator so at the speed a real cluster's steps ran, which a profile timed on a quiet
    machine does not know (neighbouring workers and the other parts on the same cores)."""

    base: StepModel
    decode: float
    prefill: float
    rows: float
    row_tokens: int

    @property
    def reads_decode_context(self) -> bool:
        return self.base.reads_decode_context

    @property
    def overlap_pays(self) -> bool:
        return self.base.overlap_pays

    def _factor(self, total: BatchShape, steps: int) -> float:
        if not total.prefill_tokens:
            return self.decode
        return self.rows if holds_rows(total, steps, self.row_tokens) else self.prefill

    def step_seconds(self, shape: BatchShape) -> float:
        return self.base.step_seconds(shape) * self._factor(shape, 1)

    def steps_seconds(self, total: BatchShape, steps: int) -> float:
        return self.base.steps_seconds(total, steps) * self._factor(total, steps)
