"""A cluster run forward for a few intervals, coarse and fast: what the simulate policy
scores each candidate split with (one run per candidate, every interval).

It is not services/sim (that one runs the production scheduler, request by request, and
takes seconds per minute of traffic): it moves cohorts of requests, one per ``dt`` of
arrivals, through the same stages with the same step-time model, in ``dt`` slices.

- Arrivals: the forecast's rate and mean lengths for each interval ahead, all of a cohort
  the same length. Prompts longer than ``max_local_prefill_length`` go to the prefill queue,
  the others to the decode workers' local prefill.
- Prefill workers: a FIFO served at ``T`` tokens per second each (measured, else the step
  model's); the queue's backlog now is cohorts of its jobs, arrived evenly over its oldest
  job's wait;
  prompt tokens the prefill workers are computing now join the queue's head.
- Decode workers: local prefill takes a share ``f`` of their time (at most 90%); the rest
  runs decode steps of batch ``running / workers`` at the step model's time. A cohort's
  inter-token gap is ``step / (1 - f)``, and its largest gap, while a local prefill chunk
  shares its steps, the step that carries that chunk. A cohort holds its decode-side KV
  blocks (prompt + output) from its arrival, as a decode worker reserves them before a
  remote prefill: it waits for them before its prefill, then for a seat (max_num_seqs)
  before its first token, its TTFT running on.
- Running requests now: one cohort that met its TTFT target, with the output tokens they
  have still to produce (WorkerSignals.decode_tokens_left; half the forecast's for a
  request that set no max_tokens, and for all when the workers report nothing).
- A worker the candidate adds serves ``worker_ready_s`` from now (one starting now: half
  that); a worker it removes stops at once, its requests moved without cost (the KV
  transfer's few milliseconds are left out).

Goodput: a cohort is good when its TTFT is within ttft_p90_s and its largest gap within
itl_p90_s, as services/bench judges a request. Requests unfinished at the horizon are
judged on what is known by then (a TTFT already past the target is bad).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from services.common.config import PlannerConfig
from services.planner.capacity import Capacity
from services.planner.decision import Split
from services.planner.forecast import Load

BACKLOG_PIECES = 16


@dataclass(slots=True)
class _Cohort:
    n: float  # requests
    arrived: float
    input_tokens: float
    output_tokens: float
    left: float = 0.0  # prompt tokens to prefill (all of them), then output tokens each
    ttft: float = -1.0  # seconds; -1 until the first token
    max_gap: float = 0.0


@dataclass(frozen=True, slots=True)
class Start:
    """The cluster now, as the forward run starts from it."""

    prefill_ready: int
    decode_ready: int
    current: Split  # ready and starting
    queue_tokens: int = 0
    queue_jobs: int = 0
    queue_oldest_wait_s: float = 0.0
    prefill_in_progress: int = 0  # prompt tokens the prefill workers compute now
    local_pending: int = 0  # prompt tokens the decode workers prefill now
    running: int = 0
    decode_tokens_left: int = 0  # over the running requests not counted in running_unbounded
    running_unbounded: int = 0  # running requests whose length left is unknown
    prefill_tok_s: float = 0.0  # measured; 0: the step model's


@dataclass(frozen=True, slots=True)
class Prediction:
    split: Split
    requests: float
    good: float
    waiting: float = 0.0  # requests with no first token yet at the horizon

    @property
    def goodput(self) -> float:
        return self.good / self.requests if self.requests else 1.0


def _ramp(now: int, want: int, ready_now: int, start_s: float, ready_s: float) -> list[tuple[float, int]]:
    """(from t, workers serving) steps: removals at once, additions at ``ready_s``, workers
    already starting at ``start_s``."""
    if want <= ready_now:
        return [(0.0, want)]
    starting = max(0, min(now, want) - ready_now)
    added = max(0, want - max(now, ready_now))
    steps = [(0.0, ready_now)]
    if starting:
        steps.append((start_s, ready_now + starting))
    if added:
        steps.append((ready_s, ready_now + starting + added))
    return sorted(steps)


def _at(steps: list[tuple[float, int]], t: float) -> int:
    n = steps[0][1]
    for t0, k in steps:
        if t >= t0:
            n = k
    return n


def run_forward(start: Start, split: Split, loads: list[Load], cap: Capacity,
                cfg: PlannerConfig) -> Prediction:
    """The predicted goodput of running ``split`` for ``len(loads)`` intervals (one Load
    per interval). See the module docstring for what is modelled."""
    interval = cfg.interval_s
    horizon = interval * len(loads)
    dt = min(0.5, cfg.ttft_p90_s / 4)
    ready_s = cfg.worker_ready_s
    pre = _ramp(start.current.prefill, split.prefill, start.prefill_ready, ready_s / 2, ready_s)
    dec = _ramp(start.current.decode, split.decode, start.decode_ready, ready_s / 2, ready_s)
    head = loads[0]
    arrived: deque[_Cohort] = deque()  # waiting for decode-side KV blocks
    remote_q: deque[_Cohort] = deque()
    local_q: deque[_Cohort] = deque()
    seat_q: deque[_Cohort] = deque()  # prefilled, waiting for a decode seat
    running: list[_Cohort] = []
    done: list[_Cohort] = []
    used = 0.0  # decode-side KV blocks held
    backlog = start.queue_tokens + start.prefill_in_progress
    if backlog:
        # NOTE: in pieces (their arrivals spread over the oldest's wait): one lump would
        # finish all at once or not at all, and every split would leave it waiting alike
        jobs = max(1, start.queue_jobs)
        pieces = min(jobs, BACKLOG_PIECES)
        for i in range(pieces):
            c = _Cohort(jobs / pieces, -start.queue_oldest_wait_s * (1 - i / pieces),
                        backlog / jobs, head.output_tokens)
            c.left = backlog / pieces
            remote_q.append(c)
            used += _blocks(c, cap)
    if start.local_pending:
        c = _Cohort(1, 0.0, start.local_pending, head.output_tokens, start.local_pending)
        local_q.append(c)
        used += _blocks(c, cap)
    if start.running:
        guess = head.output_tokens / 2
        known = start.decode_tokens_left or start.running_unbounded  # else nothing is
        each = ((start.decode_tokens_left + start.running_unbounded * guess) / start.running
                if known else guess)
        c = _Cohort(start.running, -1.0, head.input_tokens, each, each, ttft=0.0)
        running.append(c)
        used += _blocks(c, cap)
    total = sum(c.n for c in (*remote_q, *local_q, *running))
    t = 0.0
    while t < horizon - 1e-9:
        load = loads[min(int(t / interval), len(loads) - 1)]
        n_p, n_d = _at(pre, t), max(1, _at(dec, t))
        k = load.rate * dt
        if k > 0:
            total += k
            c = _Cohort(k, t, load.input_tokens, load.output_tokens)
            c.left = k * load.input_tokens
            arrived.append(c)
        # the decode worker holds blocks for a prompt from its arrival (a remote prefill's
        # are reserved while it queues): no blocks, no prefill
        while arrived and used + _blocks(arrived[0], cap) <= n_d * cap.kv_blocks:
            c = arrived.popleft()
            used += _blocks(c, cap)
            (remote_q if cap.remote(c.input_tokens) else local_q).append(c)
        tok_s = start.prefill_tok_s or cap.prefill_tok_s(load.input_tokens)
        _serve(remote_q, n_p * tok_s * dt, seat_q)
        f = 0.0
        local_in = 0.0
        if local_q:
            p_tok = cap.prefill_s_per_token(local_q[0].input_tokens)
            f = min(0.9, sum(c.left for c in local_q) * p_tok / (n_d * dt))
            local_in = local_q[0].input_tokens
            _serve(local_q, f * n_d * dt / p_tok, seat_q)
        seqs = sum(c.n for c in running)
        while seat_q and seqs + seat_q[0].n <= n_d * cap.max_seqs:
            c = seat_q.popleft()
            seqs += c.n
            c.ttft = t + dt - c.arrived
            c.left = c.output_tokens - 1
            running.append(c)
        if running:
            b = seqs / n_d
            ctx = sum(c.n * (c.input_tokens + c.output_tokens / 2) for c in running) / seqs
            step = cap.decode_step_s(b, ctx)
            gap = step / (1 - f)
            worst = max(gap, cap.chunk_gap_s(b, ctx, local_in)) if f > 0 else gap
            produced = (1 - f) * dt / step
            still: list[_Cohort] = []
            for c in running:
                c.left -= produced
                if worst > c.max_gap:
                    c.max_gap = worst
                if c.left <= 0:
                    done.append(c)
                    used -= _blocks(c, cap)
                else:
                    still.append(c)
            running = still
        t += dt
    good = 0.0
    ttft_s, itl_s = cfg.ttft_p90_s, cfg.itl_p90_s
    for c in done + running:
        if c.ttft <= ttft_s and c.max_gap <= itl_s:
            good += c.n
    waiting = 0.0
    for c in (*arrived, *remote_q, *local_q, *seat_q):
        waiting += c.n
        if horizon - c.arrived <= ttft_s:  # not late yet: its fate is open, count it good
            good += c.n
    return Prediction(split, total, good, waiting)


def _blocks(c: _Cohort, cap: Capacity) -> float:
    return c.n * cap.blocks(c.input_tokens + c.output_tokens)


def _serve(queue: deque[_Cohort], budget: float, out: deque[_Cohort]) -> None:
    """Prefill ``budget`` prompt tokens of ``queue``, first come first served."""
    while queue and budget > 0:
        c = queue[0]
        used = min(budget, c.left)
        c.left -= used
        budget -= used
        if c.left <= 1e-9:
            out.append(queue.popleft())
