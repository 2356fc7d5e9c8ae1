"""Fitted step-time profiles of the real engine, and the step model a config names.

A profile is written by ``tandem sim profile`` (services/sim/profiler.py) on the machine it
models and read back by ``step_model_for`` when ``engine.step_model`` is a path. Its YAML
holds the coefficients of both step kinds, the fit's error over the measured points,
what the points were measured on (CPU model and flags or CUDA device, torch threads, the
engine's dtype, quantization and CPU kernels, model, block size, date) and the points.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from services.common.config import ClusterConfig, EngineConfig
from services.steptime.model import BatchShape, MockStepModel, StepModel, holds_rows

FORMAT = 1


class ProfileError(ValueError):
    """A profile file that is missing or cannot be read; the message names the file."""


@dataclass(frozen=True, slots=True)
class MeasuredStep:
    """One measured point: a step's shape and the seconds it took (a median of repeats)."""

    shape: BatchShape
    seconds: float


@dataclass(frozen=True, slots=True)
class DecodeCost:
    """A decode-only step: ``base_s + per_seq_s * decode_seqs + per_context_s *
    decode_context``. On a CPU with the int4 kernels it is one C++ call per step
    (runner/cpu_decode.py), much cheaper per sequence than the torch path."""

    base_s: float = 0.0
    per_seq_s: float = 0.0
    per_context_s: float = 0.0

    @staticmethod
    def features(s: BatchShape) -> list[float]:
        return [1.0, s.decode_seqs, s.decode_context]


@dataclass(frozen=True, slots=True)
class PrefillCost:
    """A step with prefill slices (and any decodes beside them): ``base_s + per_token_s *
    prefill_tokens + per_fresh_context_s * (prefill_context - prefill_prefix_context) +
    per_prefix_context_s * prefill_prefix_context + per_prefix_end_s * prefill_prefix_end
    + per_decode_seq_s * decode_seqs + per_decode_context_s * decode_context``."""

    base_s: float = 0.0
    per_token_s: float = 0.0
    per_fresh_context_s: float = 0.0
    per_prefix_context_s: float = 0.0
    per_prefix_end_s: float = 0.0
    per_decode_seq_s: float = 0.0
    per_decode_context_s: float = 0.0

    @staticmethod
    def features(s: BatchShape) -> list[float]:
        return [1.0, s.prefill_tokens, s.prefill_context - s.prefill_prefix_context,
                s.prefill_prefix_context, s.prefill_prefix_end, s.decode_seqs, s.decode_context]


@dataclass(frozen=True, slots=True)
class FitError:
    """``|fitted - measured| / measured`` over measured points: mean and max."""

    mean: float = 0.0
    max: float = 0.0


@dataclass(frozen=True, slots=True)
class ProfileStepModel:
    """Linear costs, every coefficient >= 0: ``decode`` for decode-only steps and
    ``prefill`` for steps with a prefill slice (the engine runs the two on different code
    paths: one fit over both is off by 2x at either end); and, where the profiled engine
    runs steps with up to ``row_tokens`` prefill tokens as rows of its one-call CPU step
    (``ModelRunner.row_step_tokens``), ``rows`` for those steps: a row attends its whole
    context, so a small chunk after a long prefix costs more per unit of context than the
    eager forward's line gives it, and one line over both regimes was off by up to 44%.

    ``overlap_pays``: the profiled engine ran its overlapped loop (its scheduler works while
    the device computes: the times are the forward's alone), so the simulation models that
    loop under ``engine.overlap: auto``. ``error``: the fit's relative error over all
    measured points, ``decode_error`` and ``prefill_error`` over each kind; ``measured_on``:
    the machine and engine; ``points``: the measured steps it was fitted on (``rows_error``
    over the row steps among them, part of ``prefill_error`` too)."""

    decode: DecodeCost
    prefill: PrefillCost
    overlap_pays: bool = False
    error: FitError = FitError()
    decode_error: FitError = FitError()
    prefill_error: FitError = FitError()
    measured_on: dict[str, Any] = field(default_factory=dict)
    points: tuple[MeasuredStep, ...] = ()
    rows: PrefillCost | None = None
    row_tokens: int = 0  # 0 (or no ``rows``): every step with prefill is ``prefill``'s
    rows_error: FitError = FitError()

    @property
    def reads_decode_context(self) -> bool:
        return self.decode.per_context_s > 0 or self.prefill.per_decode_context_s > 0

    def step_seconds(self, shape: BatchShape) -> float:
        if shape.prefill_tokens:
            return self.steps_seconds(shape, 1)
        d = self.decode
        return d.base_s + d.per_seq_s * shape.decode_seqs + d.per_context_s * shape.decode_context

    def runs_as_rows(self, total: BatchShape, steps: int) -> bool:
        """Whether ``steps`` prefill steps adding up to ``total`` are row steps: each holds
        ``row_tokens`` prefill tokens or fewer (``total`` spread evenly over them)."""
        return self.rows is not None and holds_rows(total, steps, self.row_tokens)

    def steps_seconds(self, total: BatchShape, steps: int) -> float:
        p = self.rows if self.rows is not None and self.runs_as_rows(total, steps) else self.prefill
        return (p.base_s * steps + p.per_token_s * total.prefill_tokens
                + p.per_fresh_context_s * (total.prefill_context - total.prefill_prefix_context)
                + p.per_prefix_context_s * total.prefill_prefix_context
                + p.per_prefix_end_s * total.prefill_prefix_end
                + p.per_decode_seq_s * total.decode_seqs
                + p.per_decode_context_s * total.decode_context)

    def save(self, path: str | Path) -> None:
        doc = {
            "format": FORMAT,
            "form": "decode-only, prefill and (with row_tokens) row steps, each linear in "
                    "BatchShape's fields",
            "decode": asdict(self.decode),
            "prefill": asdict(self.prefill),
            **({"rows": asdict(self.rows), "row_tokens": self.row_tokens}
               if self.rows is not None else {}),
            "overlap_pays": self.overlap_pays,
            "fit": {"points": len(self.points),
                    **{k: {"mean_rel_error": round(e.mean, 4), "max_rel_error": round(e.max, 4)}
                       for k, e in (("all", self.error), ("decode", self.decode_error),
                                    ("prefill", self.prefill_error),
                                    *((("rows", self.rows_error),) if self.rows is not None else ()))}},
            "measured_on": self.measured_on,
            "points": [{**asdict(p.shape), "seconds": p.seconds} for p in self.points],
        }
        Path(path).write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> ProfileStepModel:
        """Raises ProfileError naming the file when it is missing or not a profile."""
        p = Path(path)
        if not p.is_file():
            raise ProfileError(f"step-time profile not found: {p} (write one with "
                               "`tandem sim profile --out FILE`, or set engine.step_model: mock)")
        try:
            doc = yaml.safe_load(p.read_text(encoding="utf-8"))
            if not isinstance(doc, dict) or doc.get("format") != FORMAT:
                raise ValueError(f"not a format-{FORMAT} profile")
            costs = [_cost(kind, doc[name]) for name, kind in (("decode", DecodeCost), ("prefill", PrefillCost))]
            overlap = doc["overlap_pays"]
            if not isinstance(overlap, bool):
                raise ValueError(f"overlap_pays must be true or false, not {overlap!r}")
            fit = doc["fit"]

            def fit_error_of(kind: str) -> FitError:
                return FitError(float(fit[kind]["mean_rel_error"]), float(fit[kind]["max_rel_error"]))

            errors = [fit_error_of(k) for k in ("all", "decode", "prefill")]
            points = tuple(MeasuredStep(BatchShape(**{k: int(q[k]) for k in _SHAPE}), float(q["seconds"]))
                           for q in doc.get("points") or ())
            # NOTE: optional: profiles written before the row steps had a cost of their own
            rows = _cost(PrefillCost, doc["rows"]) if doc.get("rows") is not None else None
            row_tokens = int(doc.get("row_tokens") or 0) if rows is not None else 0
            if rows is not None and row_tokens <= 0:
                raise ValueError(f"a rows cost needs row_tokens > 0, not {doc.get('row_tokens')!r}")
            rows_error = fit_error_of("rows") if rows is not None and "rows" in fit else FitError()
        except (yaml.YAMLError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ProfileError(f"step-time profile {p} cannot be read: {e!r}") from None
        return cls(*costs, overlap, *errors, measured_on=doc.get("measured_on") or {}, points=points,
                   rows=rows, row_tokens=row_tokens, rows_error=rows_error)


_SHAPE = tuple(f.name for f in fields(BatchShape))


def _cost(kind: type[DecodeCost] | type[PrefillCost], doc: dict[str, Any]) -> Any:
    values = {f.name: float(doc[f.name]) for f in fields(kind)}
    negative = [k for k, v in values.items() if v < 0]
    if negative:
        raise ValueError(f"{kind.__name__}: negative coefficients {negative}")
    return kind(**values)


def nnls(a: np.ndarray, b: np.ndarray, iters: int = 500) -> np.ndarray:
    """``argmin |a x - b|`` subject to ``x >= 0`` (Lawson-Hanson active set)."""
    m, n = a.shape
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    w = a.T @ (b - a @ x)
    tol = 10 * np.finfo(float).eps * np.linalg.norm(a, 1) * max(m, n)
    for _ in range(iters):
        if passive.all() or (w[~passive] <= tol).all():
            break
        j = int(np.argmax(np.where(passive, -np.inf, w)))
        passive[j] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
        w = a.T @ (b - a @ x)
    return x


# Huber's constant: residuals within HUBER robust standard deviations keep full weight.
HUBER = 1.345
ROBUST_ITERS = 20


def _fit_cost(kind: type[DecodeCost] | type[PrefillCost], points: list[MeasuredStep]) -> Any:
    """The non-negative least-squares fit of one kind's points, in relative error (each row
    weighted by ``1 / seconds``, so a 5 ms decode step counts as much as a 1 s prefill),
    made robust by iterative reweighting (Huber): a point another process slowed down on a
    shared machine loses weight instead of dragging every coefficient towards it."""
    t = np.array([p.seconds for p in points])
    a = np.array([kind.features(p.shape) for p in points]) / t[:, None]
    # NOTE: columns scaled to unit norm first: token counts and context products differ by
    # orders of magnitude, and the active-set solve is then well conditioned.
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    a = a / scale
    ones = np.ones(len(points))
    w = ones
    for _ in range(ROBUST_ITERS):
        x = nnls(a * w[:, None], w)
        r = np.abs(a @ x - 1.0)
        # NOTE: the robust spread floored at 1%: an exact fit must not turn every point
        # into an outlier.
        s = max(1.4826 * float(np.median(r)), 0.01)
        w_next = np.sqrt(np.minimum(1.0, HUBER * s / np.maximum(r, 1e-12)))
        if np.allclose(w_next, w, atol=1e-6):
            break
        w = w_next
    return kind(*map(float, x / scale))


def fit_error(model: ProfileStepModel, points: list[MeasuredStep]) -> FitError:
    """``|predicted - measured| / measured`` of ``model`` over ``points``: mean and max."""
    rel = [abs(model.step_seconds(p.shape) - p.seconds) / p.seconds for p in points]
    return FitError(float(np.mean(rel)), float(np.max(rel))) if rel else FitError()


MIN_POINTS = 3  # of each kind


def fit_profile(points: list[MeasuredStep], measured_on: dict[str, Any] | None = None,
                overlap_pays: bool = False, row_tokens: int = 0) -> ProfileStepModel:
    """Fit decode-only steps and steps with prefill apart (ValueError with fewer than
    ``MIN_POINTS`` of either kind); with ``row_tokens`` (the profiled runner's
    ``row_step_tokens``) the steps with that many prefill tokens or fewer apart again, where
    both sides of that line hold ``MIN_POINTS`` (else one prefill cost covers them)."""
    decode = [p for p in points if not p.shape.prefill_tokens]
    prefill = [p for p in points if p.shape.prefill_tokens]
    if min(len(decode), len(prefill)) < MIN_POINTS:
        raise ValueError(f"{len(decode)} decode and {len(prefill)} prefill points cannot fit a "
                         f"profile: it needs {MIN_POINTS} of each")
    rows = [p for p in prefill if p.shape.prefill_tokens <= row_tokens]
    eager = [p for p in prefill if p.shape.prefill_tokens > row_tokens]
    split = row_tokens > 0 and min(len(rows), len(eager)) >= MIN_POINTS
    model = ProfileStepModel(_fit_cost(DecodeCost, decode),
                             _fit_cost(PrefillCost, eager if split else prefill),
                             overlap_pays, measured_on=measured_on or {}, points=tuple(points),
                             rows=_fit_cost(PrefillCost, rows) if split else None,
                             row_tokens=row_tokens if split else 0)
    return replace(model, error=fit_error(model, points), decode_error=fit_error(model, decode),
                   prefill_error=fit_error(model, prefill),
                   rows_error=fit_error(model, rows) if split else FitError())


# What ``engine.step_model: auto`` means for the torch runner: SmolLM2-135M measured on a
# 2-vCPU Xeon (bfloat16 + int4; measured_on inside says the rest). Another model or machine
# is mispredicted by a factor: profile it (`tandem sim profile`) and name the file.
SHIPPED_CPU_PROFILE = Path(__file__).with_name("profiles") / "cpu-smollm2.yaml"


def step_model_for(cfg: ClusterConfig | EngineConfig) -> StepModel:
    """The step model ``engine.step_model`` names: the mock runner's cost (``mock``, or
    ``auto`` with the mock runner), a profile file, or (``auto`` with the torch runner) the
    shipped CPU profile. ProfileError when a file is missing or bad. (An engine, which
    knows its own section only, passes it.)"""
    engine = cfg if isinstance(cfg, EngineConfig) else cfg.engine
    name = engine.step_model
    if name == "mock" or (name == "auto" and engine.runner == "mock"):
        return MockStepModel.of(engine.mock)
    return ProfileStepModel.load(SHIPPED_CPU_PROFILE if name == "auto" else name)
