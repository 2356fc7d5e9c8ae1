"""The prefill a step may take under an ITL target: the one place that computes it, for the
scheduler's step budget (``engine.itl_target_ms``) and for the decode worker's prediction of
a local prefill (services/decode/disagg.py).

A step that holds prefill slices beside ``r`` decodes reading ``D`` tokens of KV costs, on
the linear step models (services/steptime/model.py, profile.py),

    fixed(r, D) + sum over slices of slice(t, s)
    fixed(r, D) = base + per_decode_seq * r + per_decode_context * D
    slice(t, 0) = per_token * t + per_context * t * t                (a fresh prompt's first chunk)
    slice(t, s) = per_token * t + per_prefix_context * t * (s + t) + per_prefix_end * (s + t)

for a slice of ``t`` tokens after ``s`` computed ones. The running streams wait for the
whole step, so under a target ``T`` a step's slices share ``T / speed - fixed(r, D)`` model
seconds, and ``slice_tokens`` solves the quadratic for the most tokens a slice fits in what is
left. ``speed`` (``DeviceSpeed``) is how long this engine's steps really take against the
model's prediction (for steps with prefill, the ones a target governs): the shipped profile
was timed with one thread on one machine, and an engine with two threads, or another
instance of the CPU, runs its steps in another time (docs/engine.md "The ITL target"). The coefficients are read off the model once
(``StepCost.of``): the scheduler's step does float arithmetic only.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from services.common.config import EngineConfig
from services.steptime.model import BatchShape, StepModel
from services.steptime.profile import step_model_for


@dataclass(frozen=True, slots=True)
class StepCost:
    """A step with prefill on a linear step model, by the terms of the module docstring."""

    base_s: float
    per_decode_seq_s: float
    per_decode_context_s: float
    per_token_s: float
    per_context_s: float
    per_prefix_context_s: float  # per_context_s included: a slice after a prefix pays this alone
    per_prefix_end_s: float
    # A step of decodes alone, which a model may cost apart (a CPU's one-call decode kernel)
    decode_base_s: float = 0.0
    decode_per_seq_s: float = 0.0
    decode_per_context_s: float = 0.0
    # The model's row steps (StepModel.row_tokens), costed apart: the prefill terms above
    # are then those of the longer steps
    rows: StepCost | None = None

    @classmethod
    def of(cls, model: StepModel) -> StepCost:
        """Read the coefficients off ``model`` by evaluating one-step shapes (exact for the
        linear models; a nonlinear one would be linearised around the empty step)."""
        # NOTE: the prefill terms are read beside more prefill tokens than a row step holds
        # (a linear model's differences do not depend on where they are taken)
        eager = cls._prefill_terms(model, model.row_tokens + 1 if model.row_tokens else 0)
        rows = cls._prefill_terms(model, 1) if model.row_tokens else None
        # NOTE: step_seconds, not steps_seconds: a shape without prefill is a decode-only step.
        d0 = model.step_seconds(BatchShape())
        return cls(*eager, d0,
                   model.step_seconds(BatchShape(decode_seqs=1)) - d0,
                   model.step_seconds(BatchShape(decode_context=1)) - d0,
                   None if rows is None else cls(*rows))

    @staticmethod
    def _prefill_terms(model: StepModel, at: int) -> tuple[float, ...]:
        """(base, per decode seq, per decode context, per token, per context, per prefix
        context, per prefix end) of a step with prefill, read beside ``at`` prefill tokens."""
        ref = model.steps_seconds(BatchShape(prefill_tokens=at), 1)

        def per(**field: int) -> float:
            return model.steps_seconds(BatchShape(**{"prefill_tokens": at, **field}), 1) - ref

        per_token = per(prefill_tokens=at + 1)
        # NOTE: a slice after a prefix counts in both prefill_context and prefill_prefix_context.
        return (ref - per_token * at, per(decode_seqs=1), per(decode_context=1), per_token,
                per(prefill_context=1), per(prefill_context=1, prefill_prefix_context=1),
                per(prefill_prefix_end=1))

    def fixed_seconds(self, decode_seqs: int, decode_context: int) -> float:
        """A prefill step's seconds before its slices: the base and the decodes beside them."""
        return (self.base_s + self.per_decode_seq_s * decode_seqs
                + self.per_decode_context_s * decode_context)

    def decode_seconds(self, decode_seqs: int, decode_context: int) -> float:
        """A step of these decodes alone."""
        return (self.decode_base_s + self.decode_per_seq_s * decode_seqs
                + self.decode_per_context_s * decode_context)

    def shape_seconds(self, shape: BatchShape, rows: bool = False) -> float:
        """What a step of ``shape`` takes: a decode-only step, or a prefill step with its
        decodes and its fresh and after-prefix context (the model's own answer, for the
        linear models); ``rows``: one the runner ran as rows, at the row cost if any."""
        if rows and self.rows is not None and shape.prefill_tokens:
            return self.rows.shape_seconds(shape)
        if not shape.prefill_tokens:
            return self.decode_seconds(shape.decode_seqs, shape.decode_context)
        fresh = shape.prefill_context - shape.prefill_prefix_context
        return (self.fixed_seconds(shape.decode_seqs, shape.decode_context)
                + self.per_token_s * shape.prefill_tokens + self.per_context_s * fresh
                + self.per_prefix_context_s * shape.prefill_prefix_context
                + self.per_prefix_end_s * shape.prefill_prefix_end)

    def slice_seconds(self, tokens: int, start: int) -> float:
        """What a slice of ``tokens`` after ``start`` computed tokens adds to its step."""
        if start:
            end = start + tokens
            return (self.per_token_s * tokens + self.per_prefix_context_s * tokens * end
                    + self.per_prefix_end_s * end)
        return self.per_token_s * tokens + self.per_context_s * tokens * tokens

    def slice_tokens(self, seconds: float, start: int) -> int:
        """The most tokens a slice after ``start`` computed tokens fits in ``seconds``
        (0 when not one does); the root of ``a t^2 + b t + c = seconds``."""
        if start:
            a = self.per_prefix_context_s
            b = self.per_token_s + a * start + self.per_prefix_end_s
            left = seconds - self.per_prefix_end_s * start
        else:
            a, b, left = self.per_context_s, self.per_token_s, seconds
        if left <= 0:
            return 0
        if a > 0:
            t = (math.sqrt(b * b + 4 * a * left) - b) / (2 * a)
        elif b > 0:
            t = left / b
        else:
            return 1 << 62  # tokens cost nothing on this model
        return int(t)


# DeviceSpeed: the least weight of a new step (a fit's first steps weigh more: below), the
# bounds of one step's measured / predicted, and how far from its fit's mean one step counts
# (a step stalled by a page fault or a busy core counts as twice the mean at most).
SPEED_WEIGHT = 0.05
SPEED_BOUNDS = (0.25, 4.0)
STEP_SWING = 2.0
# How many spreads above its mean ratio a target plans a step at (FitSpeed.plan): steps
# of one shape scatter around the fit by ~5-15% on the CPU, and a target met only on
# average is missed by every step above it (ITL p99 at 1.3-1.5x a 100 ms target before).
PLAN_SPREADS = 2.0
# The most a target plans above the mean (a fraction of it). Quiet, the spreads are ~0.05-0.12
# and the margin they give is what keeps the target; on a cluster whose workers share the
# cores they reach 0.2-0.3, mostly stalls from the neighbours that no smaller chunk avoids,
# and the whole margin cost TTFT without lowering the served ITL tail.
MAX_PLAN_MARGIN = 0.25


@dataclass(slots=True)
class FitSpeed:
    """One fit's measured / predicted seconds (``DeviceSpeed``): ``mean`` from 1, ``spread``
    (the moving root-mean-square of a step's relative deviation from the mean), the steps
    seen, and their seconds as modelled and as timed, summed (unclamped: the ratio of two
    readings' differences is the speed over the window between them, which ``tandem sim
    calibrate`` runs the simulator at)."""

    mean: float = 1.0
    spread: float = 0.0
    steps: int = 0
    model_s: float = 0.0
    timed_s: float = 0.0

    def observe(self, r: float, predicted_s: float, measured_s: float) -> None:
        """One step of ratio ``r`` (bounded already), ``predicted_s`` modelled, ``measured_s``
        timed."""
        self.steps += 1
        w = max(1.0 / (self.steps + 1), SPEED_WEIGHT)
        mean = self.mean
        r = min(max(r, mean / STEP_SWING), mean * STEP_SWING)
        dev = (r - mean) / mean
        self.mean = mean + w * (r - mean)
        self.spread = math.sqrt(self.spread * self.spread + w * (dev * dev - self.spread * self.spread))
        self.model_s += predicted_s
        self.timed_s += measured_s

    def plan(self) -> float:
        """The ratio a target plans this fit's steps at: the mean, ``PLAN_SPREADS`` spreads
        above, at most ``MAX_PLAN_MARGIN`` of it above."""
        return self.mean * (1.0 + min(PLAN_SPREADS * self.spread, MAX_PLAN_MARGIN))


@dataclass(slots=True)
class DeviceSpeed:
    """Measured / predicted seconds of this engine's steps, a ``FitSpeed`` for each of the
    model's three fits: ``decode`` (decode-only steps), ``prefill`` (steps with prefill on
    the eager forward, beside decodes or not) and ``rows`` (steps whose prefill ran as
    per-token rows: ``ChunkLimit.row_tokens``, the CPU's one-call step). They differ: with
    2 threads on the 1-thread CPU profile a decode-only step takes ~0.5 of its prediction
    (the one-call decode kernel splits across threads) and a small prefill step ~1.1 (its
    fixed cost does not); on a CPU other than the profile's, the eager forward just past
    the row limit took ~1.3x its prediction where rows took ~0.95x. The engine feeds it
    (``observe``) where its steps take real time (a CPU or CUDA runner; the mock and the
    simulator's runner take their model's time already).

    Each fit's mean weighs its n-th step ``max(1 / (n + 1), SPEED_WEIGHT)``: a running
    mean with the prior (1) as one step, then a moving one. A fit the engine uses rarely
    (the eager forward beside streams, a few steps a minute) learns its speed within its
    first few steps, where a fixed 0.05 left it ~60% of the way short after ten. One step
    counts within ``STEP_SWING`` times its fit's mean either way. A target plans at each
    fit's ``plan`` (the mean plus ``PLAN_SPREADS`` spreads), so steps that scatter above the
    mean still keep it."""

    decode: FitSpeed = field(default_factory=FitSpeed)
    prefill: FitSpeed = field(default_factory=FitSpeed)
    rows: FitSpeed = field(default_factory=FitSpeed)
    steps: int = 0

    def observe(self, with_prefill: bool, predicted_s: float, measured_s: float,
                rows: bool = False) -> None:
        if predicted_s <= 0 or measured_s <= 0:
            return
        r = min(max(measured_s / predicted_s, SPEED_BOUNDS[0]), SPEED_BOUNDS[1])
        fit = self.rows if with_prefill and rows else self.prefill if with_prefill else self.decode
        fit.observe(r, predicted_s, measured_s)
        self.steps += 1

    def fits(self) -> tuple[tuple[str, FitSpeed], ...]:
        """(name, fit) of each fit, as the metrics label them."""
        return (("decode", self.decode), ("prefill", self.prefill), ("rows", self.rows))

    def snapshot(self) -> DeviceSpeed:
        """A copy, for a reader on another thread (EngineStats)."""
        return DeviceSpeed(dataclasses.replace(self.decode), dataclasses.replace(self.prefill),
                           dataclasses.replace(self.rows), self.steps)


@dataclass(frozen=True, slots=True)
class ChunkLimit:
    """What a step may prefill under ``target_s`` (> 0): its slices share the time left
    after the running decodes, and the step still takes at least ``floor_tokens`` (one KV
    block) so a prompt never starves, whatever the target. ``speed``: how the engine's real
    steps compare with ``cost`` (the target is real seconds, the cost model seconds)."""

    cost: StepCost
    target_s: float
    floor_tokens: int
    speed: DeviceSpeed = field(default_factory=DeviceSpeed)
    # The runner's ``row_step_tokens``: a step with up to this many prefill tokens runs them
    # as rows on a kernel of its own cost (0: every step with prefill is the eager forward).
    row_tokens: int = 0
    # ``engine.lone_step_target_ms`` in seconds: the bound on a step with no decode beside
    # its prefill (0: none, the token budget alone)
    lone_target_s: float = 0.0

    @classmethod
    def of(cls, model: StepModel, target_ms: float, block_size: int,
           speed: DeviceSpeed | None = None, row_tokens: int = 0,
           lone_target_ms: float = 0.0) -> ChunkLimit:
        if target_ms <= 0:
            raise ValueError(f"an ITL target must be positive, got {target_ms} ms")
        if lone_target_ms < 0:
            raise ValueError(f"a lone step target must be >= 0, got {lone_target_ms} ms")
        return cls(StepCost.of(model), target_ms / 1e3, block_size, speed or DeviceSpeed(),
                   row_tokens, lone_target_ms / 1e3)

    def lone_seconds_left(self) -> float:
        """Model seconds the prefill slices of a step with no decode share (inf: no bound)."""
        if not self.lone_target_s:
            return math.inf
        return self.lone_target_s / self.speed.prefill.plan() - self.cost.fixed_seconds(0, 0)

    def takes_rows(self, eager_left: float, start: int) -> bool:
        """Whether a step beside running decodes should hold at most ``row_tokens`` of
        prefill and run as rows: where the eager forward, with ``eager_left`` model seconds
        for its slices (``seconds_left``, or ``split_seconds_left`` for a step of prefill
        alone), fits no more than ``row_tokens`` of a slice after ``start`` computed tokens.
        Past ~32 tokens the eager step's fixed cost makes a slice just above the row limit
        cost far more than one at it."""
        return 0 < self.row_tokens and self.cost.slice_tokens(eager_left, start) <= self.row_tokens

    def seconds_left(self, decode_seqs: int, decode_context: int, queued: int = 0,
                     rows: bool = False) -> float:
        """Seconds the step's prefill slices share beside these decodes (may be <= 0).

        ``queued``: requests still waiting for their first token (waiting, or running and
        not done prefilling). Where they outnumber the streams the target stretches by that
        ratio: a step's prefill delays each stream's next token but brings each of them
        nearer its first, and a burst of prompts held to a sliver a step beside the few
        streams it started first would leave most of the burst waiting (32 prompts at
        once: half the output rate, 4x the TTFT, docs/engine.md "The ITL target")."""
        speed = (self.speed.rows if rows else self.speed.prefill).plan()
        return (self._target_s(decode_seqs, queued) / speed
                - self.cost_of(rows).fixed_seconds(decode_seqs, decode_context))

    def cost_of(self, rows: bool) -> StepCost:
        """The cost a step is computed by: the row steps' where it runs as rows and the
        model costs them apart."""
        return self.cost.rows if rows and self.cost.rows is not None else self.cost

    def _target_s(self, decode_seqs: int, queued: int) -> float:
        """The target, stretched where requests waiting for their first token outnumber
        the streams (``seconds_left``)."""
        return self.target_s * (queued / decode_seqs) if queued > decode_seqs > 0 else self.target_s

    def split_pays(self, decode_seqs: int, decode_context: int) -> bool:
        """Whether these decodes take less time as a step of their own than beside a prefill
        (each fit at its own measured speed): on the CPU a decode-only step runs the one-call
        decode kernel, while decodes in a prefill step run the torch path at ~2x the cost a
        sequence, so past a few streams a step of prefill alone, then one of decodes alone,
        beats mixing them."""
        c, sp = self.cost, self.speed
        return sp.decode.mean * c.decode_seconds(decode_seqs, decode_context) < sp.prefill.mean * (
            c.per_decode_seq_s * decode_seqs + c.per_decode_context_s * decode_context)

    def split_seconds_left(self, decode_seqs: int, decode_context: int, queued: int = 0) -> float:
        """Model seconds the slices of a step of prefill alone share, the running streams
        skipping it for a step of their decodes alone right after: they wait for both, so
        the two together keep the target."""
        c, sp = self.cost, self.speed
        return ((self._target_s(decode_seqs, queued) - sp.decode.plan() * c.decode_seconds(decode_seqs, decode_context))
                / sp.prefill.plan()
                - c.fixed_seconds(0, 0))

    def first_chunk(self, tokens: int, start: int, decode_seqs: int, decode_context: int,
                    budget: int) -> int:
        """Tokens of the one prefill slice a step takes beside these decodes (or, where
        ``split_pays``, in a step of its own before theirs), of a prompt with ``tokens`` left
        after ``start`` computed ones, within ``budget`` tokens: what the scheduler gives a
        lone prefill (decode_seqs 0: no stream to protect, the budget cut to the lone step
        target)."""
        n = min(tokens, budget)
        rows = False
        if decode_seqs <= 0:
            left = self.lone_seconds_left()
            if left == math.inf:
                return n
        else:
            left = (self.split_seconds_left(decode_seqs, decode_context)
                    if self.split_pays(decode_seqs, decode_context)
                    else self.seconds_left(decode_seqs, decode_context))
            rows = self.takes_rows(left, start)
            if rows:
                n = min(n, self.row_tokens)
                left = self.seconds_left(decode_seqs, decode_context, rows=True)
        fits = self.cost_of(rows).slice_tokens(left, start)
        return min(n, max(fits, self.floor_tokens))


def chunk_limit_for(cfg: EngineConfig, device: str, model: StepModel | None = None,
                    speed: DeviceSpeed | None = None, row_tokens: int = 0) -> ChunkLimit | None:
    """``engine.itl_target_ms``'s limit for an engine computing on ``device`` (its
    RunnerInfo's) modelled by ``model`` (None: the one ``engine.step_model`` names), its
    steps running ``speed`` against the model (None: as the model says, until observed);
    None when off: no target, or a CUDA device under ``step_model: auto``, whose shipped
    profile models a CPU (its chunks would be a GPU's hundredth)."""
    target = cfg.itl_target_ms
    if not target or (cfg.step_model == "auto" and device.startswith("cuda")):
        return None
    return ChunkLimit.of(model or step_model_for(cfg), target, cfg.block_size, speed, row_tokens,
                         cfg.lone_step_target_ms or 0.0)


def measures_speed(device: str) -> bool:
    """Whether an engine on ``device`` (RunnerInfo's) takes real time for its steps: a CPU
    or CUDA runner. The mock and the simulator's runner take their model's time."""
    return device.startswith(("cpu", "cuda"))
