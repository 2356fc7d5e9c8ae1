"""The remote-prefill decision: a pure function of the config, the prompt, this worker's
prefix cache, its load and the prefill queue (docs/architecture.md, "Remote prefill
decision")."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from services.common.config import ClusterConfig, DisaggConfig
from services.engine.engine import EngineStats
from services.steptime.chunk import ChunkLimit, chunk_limit_for
from services.steptime.model import BatchShape, StepModel
from services.steptime.predict import prefill_seconds, prefill_shape


class DecisionReason(enum.StrEnum):
    REMOTE = "remote"  # threshold policy: long enough and the queue has room
    REMOTE_FASTER = "remote_faster"  # predict: the first token comes sooner remotely
    ITL_TARGET = "itl_target"  # predict: a local chunk would break the running streams' ITL
    LOCAL_FASTER = "local_faster"  # predict: the first token comes sooner here
    DISABLED = "disabled"  # decode.disagg.enabled is false
    SHORT = "short"  # effective prefill <= max_local_prefill_length
    QUEUE_FULL = "queue_full"  # queue holds max_prefill_queue_size requests or more
    QUEUE_TOKENS = "queue_tokens"  # queued prefill tokens + this one would exceed the bound
    NO_PREFILL_WORKERS = "no_prefill_workers"  # predict: prefill.replicas is 0
    PROMPT_LOGPROBS = "prompt_logprobs"  # needs every prompt position's logits: only here


@dataclass(frozen=True, slots=True)
class PrefillDecision:
    remote: bool
    reason: DecisionReason
    effective_tokens: int  # prompt tokens not served by this worker's prefix cache
    # predict policy: the predicted seconds to the first token either way, corrected by
    # what this worker measured (WorkerTimes.local_bias, remote_bias); 0 otherwise
    local_s: float = 0.0
    remote_s: float = 0.0
    # predict policy: what a local prefill costs the running streams (itl_weight x their
    # added delay), counted beside local_s
    itl_cost_s: float = 0.0
    # predict policy: what it costs the requests expected to arrive meanwhile (arrival_weight
    # x their wait for it), counted beside local_s
    wait_cost_s: float = 0.0


@dataclass(frozen=True, slots=True)
class WorkerTimes:
    """What the predict policy reads beside the queue: the engine's step-time model and its
    prefill chunk (``engine.max_num_batched_tokens``), this worker's prefill tokens already
    waiting, its running decodes and the KV tokens they read, the prefill workers, the
    seconds one prompt token's KV takes to arrive (bytes per token over the link), the
    limit the engine's ITL target puts on a step's prefill (None: none), the measured /
    predicted time to the first token this worker has seen on each side (1: none), and the
    requests a second reaching this worker lately (ArrivalRate)."""

    model: StepModel
    chunk: int
    pending_prefill_tokens: int
    running: int
    decode_context: int
    prefill_workers: int
    kv_seconds_per_token: float
    limit: ChunkLimit | None = None
    local_bias: float = 1.0
    remote_bias: float = 1.0
    arrival_rate: float = 0.0

    def local_chunk(self, tokens: int, start: int) -> int:
        """The chunk the engine's scheduler gives this prefill beside the running decodes:
        ``chunk`` tokens, or what the ITL target leaves (ChunkLimit.first_chunk). Its first
        chunk stands for all: deeper ones fit fewer tokens, so a long prompt's local time
        under a target is underestimated."""
        if self.limit is None:
            return self.chunk
        return self.limit.first_chunk(tokens, start, self.running, self.decode_context,
                                      self.chunk)


def worker_times(cfg: ClusterConfig, model: StepModel, stats: EngineStats,
                 kv_bytes_per_token: int, local_bias: float = 1.0,
                 remote_bias: float = 1.0, arrival_rate: float = 0.0) -> WorkerTimes:
    """The predict policy's view of a decode worker from its engine's stats (the decode
    worker's and the simulator's one way to build it)."""
    return WorkerTimes(model, cfg.engine.max_num_batched_tokens, stats.num_prefill_tokens_pending,
                       stats.num_running, stats.kv_blocks_used * cfg.engine.block_size,
                       cfg.prefill.replicas,
                       kv_bytes_per_token / (cfg.decode.disagg.kv_transfer_gbps * 1e9),
                       chunk_limit_for(cfg.engine, stats.runner.device, model,
                                       stats.step_speed,
                                       stats.row_step_tokens),
                       local_bias, remote_bias, arrival_rate)


def decide_prefill(
    cfg: DisaggConfig,
    prompt_len: int,
    cached_tokens: int,
    queue_depth: int,
    queued_prefill_tokens: int,
    times: WorkerTimes | None = None,
) -> PrefillDecision:
    """Where to prefill one request.

    ``effective = prompt_len - cached_tokens`` (``cached_tokens`` is block-accurate: what
    this worker's prefix cache serves). Local when, in this order: not ``cfg.enabled``;
    ``effective <= cfg.max_local_prefill_length``; ``queue_depth >=
    cfg.max_prefill_queue_size`` (pending + unacked jobs); ``queued_prefill_tokens +
    effective > cfg.max_prefill_queue_tokens``. Past them the threshold policy (or no
    ``times``) goes remote; the predict policy compares

    - local: this worker's waiting prefill plus ``effective``, chunked beside its running
      decodes as its scheduler chunks it (``WorkerTimes.local_chunk``: the token budget,
      or less under ``engine.itl_target_ms``), times ``local_bias``, plus ``cfg.itl_weight``
      x the delay those chunks add to each running stream (their compute) x the running
      streams, plus ``cfg.arrival_weight`` x the wait it makes the requests arriving
      meanwhile sit out (``arrival_rate`` x its own prefill time of them, each half of it
      on average: the steps it fills under an ITL target leave a newcomer little room);
    - remote: the queue's wait (its depth in tokens, estimated as ``max(queued_prefill_tokens,
      queue_depth * effective)``, spread over the prefill workers) + ``effective`` prefilled
      there + its KV's transfer, times ``remote_bias``;

    and goes remote when that costs less, or when one local chunk step (that same chunk)
    would exceed ``cfg.itl_target_ms`` for the running streams (and would not without the
    chunk): under an engine target no greater than it, only a chunk held at the one-block
    floor does.
    """
    if prompt_len < 0 or not 0 <= cached_tokens <= prompt_len:
        raise ValueError(f"cached_tokens {cached_tokens} must be within [0, prompt_len={prompt_len}]")
    if queue_depth < 0 or queued_prefill_tokens < 0:
        raise ValueError("queue_depth and queued_prefill_tokens must be >= 0")
    effective = prompt_len - cached_tokens
    if not cfg.enabled:
        reason = DecisionReason.DISABLED
    elif effective <= cfg.max_local_prefill_length:
        reason = DecisionReason.SHORT
    elif queue_depth >= cfg.max_prefill_queue_size:
        reason = DecisionReason.QUEUE_FULL
    elif queued_prefill_tokens + effective > cfg.max_prefill_queue_tokens:
        reason = DecisionReason.QUEUE_TOKENS
    elif cfg.policy == "threshold" or times is None:
        return PrefillDecision(True, DecisionReason.REMOTE, effective)
    elif times.prefill_workers <= 0:
        reason = DecisionReason.NO_PREFILL_WORKERS
    else:
        return _predict(cfg, effective, cached_tokens, queue_depth, queued_prefill_tokens, times)
    return PrefillDecision(False, reason, effective)


def _predict(cfg: DisaggConfig, effective: int, cached: int, depth: int, queued: int,
             t: WorkerTimes) -> PrefillDecision:
    model = t.model
    chunk = max(t.local_chunk(effective, cached), 1)
    local = t.local_bias * prefill_seconds(model, t.pending_prefill_tokens + effective, chunk,
                                           cached, t.running, t.decode_context)
    itl_cost = 0.0
    if t.running and cfg.itl_weight:
        # what the prefill costs the running streams: each waits for its chunks' compute
        shape, steps = prefill_shape(effective, chunk, cached)
        added = model.steps_seconds(shape, steps) - steps * model.step_seconds(BatchShape())
        itl_cost = cfg.itl_weight * t.running * max(added, 0.0)
    wait_cost = 0.0
    if t.arrival_rate and cfg.arrival_weight:
        # what the prefill costs those arriving while it runs: rate x own time of them,
        # each waiting half of it on average
        own = t.local_bias * prefill_seconds(model, effective, chunk, cached, t.running,
                                             t.decode_context)
        wait_cost = cfg.arrival_weight * t.arrival_rate * own * own / 2
    # NOTE: a prefill worker runs no decodes: its chunks are the token budget's.
    ahead = max(queued, depth * effective) // t.prefill_workers
    remote = t.remote_bias * (prefill_seconds(model, ahead, t.chunk)
                              + prefill_seconds(model, effective, t.chunk)
                              + cfg.kv_transfer_latency_s + effective * t.kv_seconds_per_token)
    if remote < local + itl_cost + wait_cost:
        return PrefillDecision(True, DecisionReason.REMOTE_FASTER, effective, local, remote,
                               itl_cost, wait_cost)
    target = cfg.itl_target_ms / 1e3
    if target and t.running:
        decode = BatchShape(decode_seqs=t.running, decode_context=t.decode_context)
        with_chunk, _ = prefill_shape(min(chunk, effective), chunk, cached, t.running,
                                      t.decode_context)
        if model.step_seconds(with_chunk) > target >= model.step_seconds(decode):
            return PrefillDecision(True, DecisionReason.ITL_TARGET, effective, local, remote,
                                   itl_cost, wait_cost)
    return PrefillDecision(False, DecisionReason.LOCAL_FASTER, effective, local, remote, itl_cost,
                           wait_cost)
