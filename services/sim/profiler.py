"""`tandem sim profile`: time the real engine's steps on this machine and fit a step-time
profile (``services.steptime.profile``) that ``engine.step_model: PATH`` names.

The engine is built as a decode worker builds it (``build_engine``, the config's threads,
dtype, quantization and kernels) and driven with ``LLMEngine.step()``; every request
ignores eos, so lengths are exact. Each timed step's ``BatchShape`` is recorded as the
simulator's runner computes it (``batch_shape``). The grid:

- prefill: one prompt slice of ``n`` tokens (16 .. ``max_num_batched_tokens``) on a fresh
  prompt, and after an already-computed prefix (a prefix-cache hit of ``ctx`` tokens);
- decode: ``b`` sequences (1 .. ``max_num_seqs``) at a few context lengths, each point the
  median of a run of decode steps.

Steps run serially (no overlap) so that a step's time belongs to its batch. The time fitted
is what a worker's step takes as it serves: the whole ``step()`` (schedule, forward,
update) when the engine runs serially, the forward alone when it overlaps (the scheduler's
work then hides behind the next forward).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch

from services.api.sampling import SamplingParams
from services.common.config import ClusterConfig, load_config
from services.engine.batch import RunnerOutput, ScheduledBatch, batch_shape
from services.engine.engine import LLMEngine
from services.engine.factory import build_engine
from services.engine.request import GenerateRequest
from services.sim.profile_check import CheckedStep, ProfileCheck
from services.steptime.model import BatchShape
from services.steptime.profile import (
    FitError,
    MeasuredStep,
    ProfileStepModel,
    fit_error,
    fit_profile,
)


@dataclass(frozen=True, slots=True)
class Grid:
    """The points measured. ``prefill``: (tokens, prefix) pairs; ``decode``: (seqs,
    context) pairs; ``mixed``: prompt lengths prefilled beside each decode point's batch
    (once each); ``repeats`` prefill runs per point, ``decode_steps`` steps per point."""

    prefill: tuple[tuple[int, int], ...]
    decode: tuple[tuple[int, int], ...]
    mixed: tuple[int, ...]
    repeats: int
    decode_steps: int


def _spread(lo: int, hi: int, n: int) -> list[int]:
    """About ``n`` values from ``lo`` to ``hi``, evenly spaced in log scale, both ends in."""
    if hi <= lo:
        return [hi]
    vals = {round(lo * (hi / lo) ** (i / (n - 1))) for i in range(n)}
    return sorted(vals | {lo, hi})


def grid_for(cfg: ClusterConfig, max_len: int, quick: bool) -> Grid:
    """Prefill tokens 16 .. max_num_batched_tokens at a fresh prompt and after a prefix;
    decode 1 .. max_num_seqs sequences at a few contexts; every point fits the KV pool."""
    e = cfg.engine
    capacity = e.num_kv_blocks * e.block_size
    budget = min(e.max_num_batched_tokens, max_len - 1)
    steps = 4 if quick else 16
    if quick:
        tokens, prefixes = _spread(16, budget, 3), [0, 512]
        seqs, contexts, most = _spread(1, e.max_num_seqs, 3), [64, 512], 4096
    else:
        tokens, prefixes = _spread(16, budget, 7), [0, 512, 2048, 4096]
        seqs, contexts, most = _spread(1, e.max_num_seqs, 5), [32, 256, 1024, 4096], 16384
    prefill = tuple((n, p - p % e.block_size) for p in prefixes for n in tokens
                    if p + n < max_len and p + n <= capacity)
    # NOTE: every decode point prefills its prompts first (untimed): at most ``most`` prompt
    # tokens a point, the largest batch of that many added. The first sequences decode
    # while the rest prefill, up to a token a prefill step ahead: the pool holds that too.
    decode = []
    for c in contexts:
        for b in sorted({*(b for b in seqs if b * c <= most), min(e.max_num_seqs, most // c)} - {0}):
            ahead = steps + b * c // budget + 2
            if c + ahead < max_len and b * (c + ahead + e.block_size) <= capacity:
                decode.append((b, c))
    mixed = (64,) if quick else (16, 128, 512)
    return Grid(prefill, tuple(decode), tuple(n for n in mixed if n < budget), 2 if quick else 3, steps)


class _ShapeTap:
    """Wraps the runner's ``execute``: the shape and forward seconds of the last batch."""

    def __init__(self, engine: LLMEngine) -> None:
        self._execute = engine.runner.execute
        self.shape = BatchShape()
        self.forward_s = 0.0
        # NOTE: an instance attribute shadows the method: the engine's serial step calls it.
        engine.runner.execute = self  # type: ignore[method-assign]

    def __call__(self, batch: ScheduledBatch) -> RunnerOutput:
        self.shape = batch_shape(batch)
        t0 = time.perf_counter()
        out = self._execute(batch)
        self.forward_s = time.perf_counter() - t0
        return out


class Profiler:
    """Drives one engine over a grid; ``serve_overlapped`` says which time is fitted."""

    def __init__(self, engine: LLMEngine, seed: int = 0) -> None:
        self.engine = engine
        self.serve_overlapped = engine.overlap
        engine.overlap = False  # NOTE: serial steps, so each step's time is its batch's
        # NOTE: the grid's shapes whole: engine.itl_target_ms would chunk the mixed steps.
        engine.scheduler.chunk_limit = None
        self.tap = _ShapeTap(engine)
        self._gen = torch.Generator().manual_seed(seed)
        self._ids = 0
        self._heads: dict[int, list[int]] = {}
        self.budget = engine.scheduler.max_num_batched_tokens
        self.max_seqs = engine.cfg.max_num_seqs

    def _prompt(self, n: int) -> list[int]:
        # NOTE: random ids above the special tokens: no prefix hit between prompts.
        return torch.randint(100, self.engine.runner.vocab_size, (n,), generator=self._gen).tolist()

    def _add(self, prompt: list[int], max_tokens: int) -> None:
        self._ids += 1
        sampling = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        request = GenerateRequest(f"profile-{self._ids}", prompt, sampling)
        self.engine.validate(request)
        self.engine.add_request(request)

    def _timed_step(self) -> MeasuredStep:
        t0 = time.perf_counter()
        self.engine.step()
        step_s = time.perf_counter() - t0
        return MeasuredStep(self.tap.shape, self.tap.forward_s if self.serve_overlapped else step_s)

    def _drain(self) -> None:
        while self.engine.has_unfinished():
            self.engine.step()

    def prefill(self, tokens: int, prefix: int) -> MeasuredStep:
        """One step computing ``tokens`` prompt tokens after ``prefix`` cached ones."""
        head = self._heads.get(prefix)
        if head is None:
            head = self._heads[prefix] = self._prompt(prefix)
        # NOTE: the prompts of other points may have evicted the head since it was computed
        # (the warm-up computes the largest prefix first): computed again, untimed, if so.
        if prefix and self.engine.prefix_hit_tokens(head + head[:1]) < prefix:
            self._add(head, 1)
            self._drain()
        self._add(head + self._prompt(tokens), 1)
        step = self._timed_step()
        self._drain()
        work = tokens * (prefix + tokens)
        if step.shape != BatchShape(tokens, work, 0, 0, *((work, prefix + tokens) if prefix else (0, 0))):
            raise RuntimeError(f"prefill {tokens} after {prefix}: the engine ran {step.shape} "
                               "(a larger engine.num_kv_blocks or max_num_batched_tokens?)")
        return step

    def decode(self, seqs: int, context: int, steps: int,
               mixed_tokens: tuple[int, ...] = ()) -> tuple[list[MeasuredStep], list[MeasuredStep]]:
        """``steps`` decode steps of ``seqs`` sequences with ``context``-token prompts, then
        a step of them beside each prompt of ``mixed_tokens`` tokens."""
        first = self._ids + 1
        # NOTE: the first prompts decode while later ones prefill; each runs until aborted.
        room = self.engine.runner.max_model_len - context - 1
        for _ in range(seqs):
            self._add(self._prompt(context), room)
        ids = {f"profile-{i}" for i in range(first, first + seqs)}
        started: set[str] = set()
        while started != ids:  # every prompt prefilled (untimed): each has its first token
            started.update(o.request_id for o in self.engine.step() if o.token_ids)
        out = [self._timed_step() for _ in range(steps)]
        bad = [s.shape for s in out if s.shape.decode_seqs != seqs or s.shape.prefill_tokens]
        mixed = []
        for n in mixed_tokens:  # a fresh prompt prefilled in the same step as the decodes
            self._add(self._prompt(n), 1)
            mixed.append(self._timed_step())
            if mixed[-1].shape.decode_seqs != seqs or mixed[-1].shape.prefill_tokens != n:
                bad.append(mixed[-1].shape)
        for rid in ids:
            self.engine.abort(rid)
        if bad:
            raise RuntimeError(f"decode of {seqs} sequences ran {bad[0]} (preempted? raise "
                               "engine.num_kv_blocks)")
        return out, mixed


def _median_step(steps: list[MeasuredStep]) -> MeasuredStep:
    mid = steps[len(steps) // 2].shape  # the middle step's context stands for the run
    return MeasuredStep(mid, statistics.median(s.seconds for s in steps))


def measure(profiler: Profiler, grid: Grid) -> Iterator[MeasuredStep]:
    """The median step of each grid point, after a warm-up of the largest of each kind."""
    if grid.prefill:
        profiler.prefill(*grid.prefill[-1])
    if grid.decode:
        profiler.decode(*max(grid.decode, key=lambda p: (p[0], -p[1])), 2)
    for tokens, prefix in grid.prefill:
        yield _median_step([profiler.prefill(tokens, prefix) for _ in range(grid.repeats)])
    for seqs, context in grid.decode:
        room = seqs < profiler.max_seqs  # a prompt joins the batch only below max_num_seqs
        steps, mixed = profiler.decode(seqs, context, grid.decode_steps,
                                       tuple(n for n in grid.mixed if room and n + seqs <= profiler.budget))
        yield _median_step(steps)
        yield from mixed


def measured_on(cfg: ClusterConfig, engine: LLMEngine, model_path: Path | None, fitted: str,
                load_before: list[float] | None) -> dict[str, object]:
    """What the profile models: the device, torch threads and the engine as built, and the
    machine's load average around the measurement (other work there skews the times)."""
    from services.bench.results import cpu_flags, cpu_model, load_average

    info = engine.runner.info
    device = str(getattr(engine.runner, "device", info.device))
    out: dict[str, object] = {
        "device": device,
        "cpu_model": cpu_model(),
        "cpu_flags": cpu_flags(),
        "torch_threads": torch.get_num_threads(),
        "dtype": info.dtype,
        "quantization": info.quantization,
        "cpu_isa": info.cpu_isa,
        "model_path": str(model_path or cfg.model.path),
        "block_size": cfg.engine.block_size,
        "max_num_seqs": cfg.engine.max_num_seqs,
        "max_num_batched_tokens": cfg.engine.max_num_batched_tokens,
        "timed": fitted,
        "torch": str(torch.__version__),
        "python": platform.python_version(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "load_average": {"before": load_before, "after": load_average()},
    }
    if device.startswith("cuda"):
        out["cuda_device"] = torch.cuda.get_device_name(torch.device(device))
    return out


def print_points(model: ProfileStepModel, points: Sequence[MeasuredStep], predicted: str) -> None:
    """Each point's measured time beside ``model``'s (headed ``predicted``) and the error."""
    print(f"{'prefill tok':>11}{'prefill ctx':>13}{'of it prefix':>13}{'decode seqs':>12}"
          f"{'decode ctx':>11}{'measured ms':>13}{predicted:>11}{'error':>8}")
    for p in points:
        s, fitted = p.shape, model.step_seconds(p.shape)
        print(f"{s.prefill_tokens:>11}{s.prefill_context:>13}{s.prefill_prefix_context:>13}"
              f"{s.decode_seqs:>12}{s.decode_context:>11}{p.seconds * 1e3:>13.2f}{fitted * 1e3:>11.2f}"
              f"{(fitted / p.seconds - 1) * 100:>7.1f}%")


def print_table(model: ProfileStepModel) -> None:
    print_points(model, model.points, "fitted ms")
    kinds = [("all", model.error), ("decode-only", model.decode_error), ("prefill", model.prefill_error)]
    if model.rows is not None:
        kinds.append((f"row (up to {model.row_tokens} prefill tokens)", model.rows_error))
    for kind, e in kinds:
        print(f"fit error over {kind} steps: mean {e.mean * 100:.1f}%, max {e.max * 100:.1f}%")


def check(profile: ProfileStepModel, points: list[MeasuredStep]) -> FitError:
    """How far ``profile`` is from steps timed now: per point, then the mean and max."""
    print_points(profile, points, "profile ms")
    return fit_error(profile, points)


def is_stale(err: FitError) -> bool:
    """Whether a profile this far from steps timed now no longer describes the machine.
    The max counts too: a profile can be close on average and a fifth off on batch-1
    decode, which sets a lightly loaded cluster's ITL."""
    from services.sim.args import CHECK_TOLERANCE

    return err.mean > CHECK_TOLERANCE or err.max > 2 * CHECK_TOLERANCE


def check_profile(cfg: ClusterConfig, path: str | Path) -> ProfileCheck:
    """Build ``cfg``'s engine here, time the quick grid and compare it with the profile at
    ``path`` (``check``: prints each point)."""
    against = ProfileStepModel.load(path)
    torch.set_num_threads(cfg.engine.threads)
    engine = build_engine(cfg).engine
    points = list(measure(Profiler(engine), grid_for(cfg, engine.runner.max_model_len, True)))
    engine.check_integrity()
    err = check(against, points)
    return ProfileCheck(str(path), err.mean, err.max, is_stale(err),
                        tuple(CheckedStep(p.shape, p.seconds, against.step_seconds(p.shape))
                              for p in points))


def main(args: argparse.Namespace) -> int:
    from services.bench.results import header, load_average, write_json
    from services.sim.args import CHECK_TOLERANCE

    if args.json_path and not args.check:
        print("tandem sim profile: --json is the verdict of --check (--out writes the profile)",
              file=sys.stderr)
        return 2
    head = header(args)
    load_before = load_average()
    cfg = load_config(args.config, args.overrides)
    if args.check:
        verdict = check_profile(cfg, args.check)
        print(f"{args.check}: mean error {verdict.mean_error * 100:.1f}%, max "
              f"{verdict.max_error * 100:.1f}% against this machine now (load average "
              f"{load_before} before)"
              + (f": past {CHECK_TOLERANCE:.0%} mean or {2 * CHECK_TOLERANCE:.0%} max, profile this "
                 "machine again (--out)" if verdict.stale else ""))
        write_json(args.json_path, {**head, **verdict.to_json()})
        return 1 if verdict.stale else 0
    torch.set_num_threads(cfg.engine.threads)
    parts = build_engine(cfg)
    engine = parts.engine
    profiler = Profiler(engine)
    grid = grid_for(cfg, engine.runner.max_model_len, args.quick)
    fitted = "forward" if profiler.serve_overlapped else "step"
    print(f"profiling {cfg.model.path} on {engine.runner.info.device} ({engine.runner.info.dtype}, "
          f"quantization {engine.runner.info.quantization}, {torch.get_num_threads()} threads): "
          f"{len(grid.prefill)} prefill and {len(grid.decode)} decode points, timing the {fitted}",
          flush=True)
    points = []
    for i, p in enumerate(measure(profiler, grid), 1):
        points.append(p)
        print(f"  [{i}] {p.shape}: {p.seconds * 1e3:.2f} ms", flush=True)
    engine.check_integrity()
    model = fit_profile(points, measured_on(cfg, engine, parts.model_path, fitted, load_before),
                        profiler.serve_overlapped, engine.runner.row_step_tokens)
    print_table(model)
    model.save(args.out)
    print(f"wrote {args.out}")
    return 0
