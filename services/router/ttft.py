"""The `ttft` routing policy: send a request where its first token is predicted soonest.

For each candidate worker ``w`` and a request of ``B`` full blocks of which ``overlap(w)``
are cached there:

    queued(w)   = pending_prefill_blocks(w) * block_size      (prefill ahead of it)
    uncached(w) = (B - overlap(w)) * block_size
    ttft(w)     = prefill_seconds(queued(w) + uncached(w) or 1 token, chunked, beside running(w) decodes)
                  + one decode step of running(w)               (the step in flight)
                  + bias(w)

``prefill_seconds`` is the engine's step-time model (engine.step_model) summed over the
chunks the scheduler would run (services/steptime/predict.py); ``running(w)`` (the sequences
that will decode beside it: those running and those queued ahead) and the KV they read come
from the load tracker. A worker whose free KV cannot hold
the request's uncached blocks ranks after every worker that can (it would queue for KV).

Each prediction is ranked with the prefill its eviction costs later added:

    rank(w) = ttft(w) + eviction_weight * evicted_blocks(w) * block_size * s_token

``evicted_blocks`` as in the ``kv`` cost (services/router/selection.py: the cached blocks the
request's uncached part pushes out of ``w``'s cache, ``unused_blocks`` the empty ones), and
``s_token`` the seconds a token of this prompt takes to prefill alone (its whole prefill's
over its tokens). Without it every new conversation goes where its first token is soonest,
the workers already caching the shared system prompt, while the others' caches sit empty.

The lowest rank wins; every candidate within ``router.affinity_band`` (relative) of it is a
tie, broken toward the most cached blocks, then the fewest active blocks, then at random.

Correction: the router remembers each prediction it routed by and, when the request's first
token is reported (RequestPhase.PREFILLED), folds ``actual - predicted`` into an
exponentially weighted mean (``router.ttft_bias_alpha``) for the worker and one for the
cluster. ``bias(w)`` is the worker's once it has ``MIN_WORKER_SAMPLES`` reports, the
cluster's before. The absolute and relative
errors go to histograms (tandem_router_ttft_prediction_error_seconds, _ratio).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from prometheus_client import Histogram

from services.router.selection import evicted_blocks
from services.steptime.model import BatchShape, StepModel
from services.steptime.predict import prefill_seconds

# Predictions kept for a first-token report that may never come (an aborted request): the
# oldest go first past this many.
MAX_PENDING_PREDICTIONS = 100_000
# Ranks a worker whose KV cannot hold the request after every worker that can.
KV_FULL_PENALTY_S = 1e6
# First tokens a worker reports before its own bias replaces the cluster's: one slow
# request (a remote prefill, a cold start) must not turn the worker holding a prefix into
# the slow one.
MIN_WORKER_SAMPLES = 16


class TtftCandidate(NamedTuple):
    worker_id: str
    overlap_blocks: int
    pending_prefill_blocks: int
    active_blocks: int
    running: int
    free_blocks: int  # KV blocks not held by live requests (-1: unknown)
    unused_blocks: int = -1  # KV blocks holding nothing, not even a cached prefix (-1: unknown)


@dataclass(frozen=True, slots=True)
class TtftSelection:
    worker_id: str
    overlap_blocks: int
    predicted_s: float


class TtftPredictor:
    """Predictions, their correction per worker and their error (module docstring)."""

    def __init__(self, model: StepModel, block_size: int, chunk_tokens: int,
                 bias_alpha: float, clock: Callable[[], float],
                 error_seconds: Histogram | None = None, error_ratio: Histogram | None = None,
                 keep_errors: bool = False) -> None:
        self.model = model
        self.block_size = block_size
        self.chunk = chunk_tokens
        self.alpha = bias_alpha
        self._clock = clock
        self.bias: dict[str, float] = {}  # per worker, once it has MIN_WORKER_SAMPLES
        self.cluster_bias = 0.0
        self._own: dict[str, tuple[float, int]] = {}  # worker -> (its error mean, reports)
        # request id -> (worker, predicted seconds without the bias, with it, routed at)
        self._pending: OrderedDict[str, tuple[str, float, float, float]] = OrderedDict()
        self._err_s = error_seconds
        self._err_ratio = error_ratio
        # (predicted, actual) per first token seen, for the simulator's report
        self.errors: list[tuple[float, float]] | None = [] if keep_errors else None

    def predict(self, c: TtftCandidate, request_blocks: int) -> float:
        """The predicted TTFT on ``c``, bias included."""
        bs = self.block_size
        uncached = request_blocks - c.overlap_blocks if c.overlap_blocks < request_blocks else 0
        context = c.active_blocks * bs
        # NOTE: at least one token: a prompt's last token is computed however much is cached
        tokens = (c.pending_prefill_blocks + uncached) * bs or 1
        t = prefill_seconds(self.model, tokens, self.chunk, c.overlap_blocks * bs, c.running,
                            context)
        if c.running:
            t += self.model.step_seconds(BatchShape(decode_seqs=c.running, decode_context=context))
        if 0 <= c.free_blocks < uncached:
            t += KV_FULL_PENALTY_S
        return t + self.bias.get(c.worker_id, self.cluster_bias)

    def routed(self, request_id: str, worker_id: str, predicted_s: float) -> None:
        """Remember the prediction ``request_id`` was routed by, to check it at its first token."""
        pending = self._pending
        if len(pending) >= MAX_PENDING_PREDICTIONS:
            pending.popitem(last=False)
        bias = self.bias.get(worker_id, self.cluster_bias)
        pending[request_id] = (worker_id, predicted_s - bias, predicted_s, self._clock())

    def first_token(self, request_id: str) -> None:
        """The request's first token is out: fold the error into its worker's bias."""
        entry = self._pending.pop(request_id, None)
        if entry is None:
            return
        worker, raw, predicted, routed_at = entry
        actual = self._clock() - routed_at
        if predicted < KV_FULL_PENALTY_S:  # a penalised prediction says nothing of the model
            miss, a = actual - raw, self.alpha
            self.cluster_bias += a * (miss - self.cluster_bias)
            mean, n = self._own.get(worker, (self.cluster_bias, 0))
            mean += a * (miss - mean)
            self._own[worker] = (mean, n + 1)
            if n + 1 >= MIN_WORKER_SAMPLES:
                self.bias[worker] = mean
            err = abs(actual - predicted)
            if self._err_s is not None:
                self._err_s.observe(err)
            if self._err_ratio is not None and actual > 0:
                self._err_ratio.observe(err / actual)
            if self.errors is not None:
                self.errors.append((predicted, actual))

    def forget(self, request_id: str) -> None:
        """The request ended before its first token (aborted): no error to learn from."""
        self._pending.pop(request_id, None)

    def worker_left(self, worker_id: str) -> None:
        self.bias.pop(worker_id, None)
        self._own.pop(worker_id, None)


def select_by_ttft(predictor: TtftPredictor, candidates: Sequence[TtftCandidate],
                   request_blocks: int, affinity_band: float, rng: random.Random,
                   eviction_weight: float = 0.0) -> TtftSelection:
    """The candidate with the lowest rank (module docstring: the predicted TTFT plus the
    prefill its evictions cost later), ties (within ``affinity_band`` of the lowest,
    relative) to the most cached blocks, then the fewest active blocks, then at random.
    ``predicted_s`` is the prediction alone. ValueError on no candidates."""
    if not candidates:
        raise ValueError("select_by_ttft: no candidate workers")
    predict = predictor.predict
    times = [predict(c, request_blocks) for c in candidates]
    ranks = times
    if eviction_weight > 0 and request_blocks:
        evicted = [evicted_blocks(request_blocks - c.overlap_blocks
                                  if c.overlap_blocks < request_blocks else 0,
                                  c.pending_prefill_blocks, c.unused_blocks) for c in candidates]
        if any(evicted):
            tokens = request_blocks * predictor.block_size
            per_block = eviction_weight * predictor.block_size * prefill_seconds(
                predictor.model, tokens, predictor.chunk) / tokens
            ranks = [t + per_block * e for t, e in zip(times, evicted, strict=True)]
    best = min(ranks)
    limit = best + abs(best) * affinity_band
    tied = [i for i, t in enumerate(ranks) if t <= limit]
    if len(tied) > 1:
        most = max(candidates[i].overlap_blocks for i in tied)
        tied = [i for i in tied if candidates[i].overlap_blocks == most]
    if len(tied) > 1:
        lightest = min(candidates[i].active_blocks for i in tied)
        tied = [i for i in tied if candidates[i].active_blocks == lightest]
    i = tied[0] if len(tied) == 1 else rng.choice(tied)
    c = candidates[i]
    return TtftSelection(c.worker_id, c.overlap_blocks, times[i])
