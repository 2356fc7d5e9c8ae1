"""The formula policy: size each role for the forecast load with closed-form rules.

Prefill: workers ``= (rate * uncached input + backlog / ttft_p90_s) / (u * T)``, where the
load is the forecast's largest over the lookahead, prompts count only when the decode
worker would send them remote (longer than ``max_local_prefill_length``), the backlog is the
queue's depth in tokens (cleared within the TTFT target), ``T`` is one prefill worker's
tokens per busy second (measured over the last interval: prefill_tokens_done /
prefill_busy_s; else the step model's), and ``u = 0.8`` keeps queueing in check. A queue
whose oldest job already waited past the target asks for one more than now.

Decode: the fewest workers ``n`` whose batch ``b`` meets three limits. ``b`` solves Little's
law ``n * b = rate * output * gap(b)`` with ``gap(b) = step(b) / (1 - f)``: the step model's
decode step at batch ``b``, stretched by ``f``, the share of each decode worker's time that
local prefills take. Limits: ``gap(b) <= itl_p90_s``, ``b <= max_num_seqs``, and the KV
held within 90% of the pools: a request holds input + output blocks from its arrival (a
remote prefill's are reserved while it queues) for ``ttft_p90_s / 2 + output * gap(b)``, so
``rate`` times that many requests hold them at once. A measured ITL p90 over the target asks
for one more than now.

No flapping: a role grows when its need exceeds what runs; it shrinks only when the need at
``1 + BAND`` times the load is below what runs (the band), and then to that. A change waits
``cooldown_s`` after the one before, but for a scale-up asked by a target missed now (the
queue's wait, the measured ITL).
"""

from __future__ import annotations

import math

from services.common.config import PlannerConfig
from services.planner.bounds import action_of, fit
from services.planner.capacity import Capacity
from services.planner.decision import Action, Decision, Split
from services.planner.forecast import Load, LoadForecast
from services.planner.signals import ClusterSignals, IntervalStats, Role
from services.planner.stabilize import ScaleDownWindow

UTILIZATION = 0.8
BAND = 0.25
KV_HEADROOM = 0.9
# Measured prefill throughput is trusted over at least this many busy seconds.
MIN_BUSY_S = 1.0


def prefill_tok_s(cap: Capacity, last: IntervalStats, input_tokens: float) -> float:
    if last.prefill_busy_s >= MIN_BUSY_S and last.prefill_tokens_done > 0:
        return last.prefill_tokens_done / last.prefill_busy_s
    return cap.prefill_tok_s(input_tokens)


def prefill_need(load: Load, signals: ClusterSignals, cap: Capacity, cfg: PlannerConfig,
                 scale: float = 1.0) -> tuple[float, str]:
    remote = cap.remote(load.input_tokens)
    demand = scale * load.rate * load.input_tokens if remote else 0.0
    backlog = signals.prefill_queue_tokens / cfg.ttft_p90_s
    t = prefill_tok_s(cap, signals.last, load.input_tokens)
    need = (demand + backlog) / (UTILIZATION * t)
    reason = "prefill_backlog" if backlog > demand else "prefill_tokens"
    if signals.prefill_queue_oldest_wait_s > cfg.ttft_p90_s:
        ready = signals.count(Role.PREFILL, ready_only=True)
        if need < ready + 1:
            need, reason = ready + 1, "queue_wait"
    return need, reason


def decode_need(load: Load, cap: Capacity, cfg: PlannerConfig, limit: int,
                scale: float = 1.0) -> tuple[int, str]:
    """The fewest decode workers (up to ``limit``) that keep the forecast's sequences under
    the ITL target, the seat limit and the KV pool; ``limit`` when none does."""
    rate = scale * load.rate
    ctx = load.input_tokens + load.output_tokens / 2
    local = 0.0 if cap.remote(load.input_tokens) else rate * load.input_tokens
    p_tok = cap.prefill_s_per_token(load.input_tokens) if local else 0.0
    blocks = cap.blocks(load.input_tokens + load.output_tokens)
    reason = "decode_itl"
    for n in range(1, limit + 1):
        f = local * p_tok / n
        if f >= UTILIZATION:
            reason = "decode_local_prefill"
            continue
        b = 1.0
        for _ in range(30):  # fixed point of Little's law; converges where stable
            b_next = rate * load.output_tokens * cap.decode_step_s(b, ctx) / (1 - f) / n
            if abs(b_next - b) < 0.01 or b_next > 4 * cap.max_seqs:
                b = b_next
                break
            b = b_next
        gap = cap.decode_step_s(b, ctx) / (1 - f)
        if gap > cfg.itl_p90_s:
            reason = "decode_itl"
        elif b > cap.max_seqs:
            reason = "decode_seats"
        elif (rate * (cfg.ttft_p90_s / 2 + load.output_tokens * gap) * blocks
              > KV_HEADROOM * n * cap.kv_blocks):
            reason = "decode_kv"
        else:
            return n, "decode_itl" if n == 1 else reason
    return limit, reason


class FormulaPolicy:
    """Implements services.planner.policy.Policy with the rules in the module docstring."""

    def __init__(self, cfg: PlannerConfig, cap: Capacity) -> None:
        self.cfg = cfg
        self.cap = cap
        self.forecast = LoadForecast()
        self.last_change = -math.inf
        self.window = ScaleDownWindow(cfg.scale_down_window_s, cfg.max_total_workers, cap.max_seqs)

    def observe(self, signals: ClusterSignals, current: Split) -> Load | None:
        """Feed this interval to the forecast; the load to size for, None before any."""
        self.forecast.update(signals.last)
        if not self.forecast.seen:
            return None
        return self.forecast.peak(self.cfg.lookahead_intervals)

    def target(self, load: Load, signals: ClusterSignals, current: Split) -> tuple[Split, str]:
        """The split the rules want (band applied, bounds kept) and its reason label."""
        cfg, cap = self.cfg, self.cap
        need_p, why_p = prefill_need(load, signals, cap, cfg)
        need_d, why_d = decode_need(load, cap, cfg, cfg.max_decode)
        if signals.last.itl_p90_s is not None and signals.last.itl_p90_s > cfg.itl_p90_s:
            ready_d = signals.count(Role.DECODE, ready_only=True)
            if need_d < ready_d + 1:
                need_d, why_d = ready_d + 1, "itl_measured"
        p = math.ceil(need_p - 1e-9)
        if p < current.prefill:
            hi, _ = prefill_need(load, signals, cap, cfg, scale=1 + BAND)
            p = max(p, min(current.prefill, math.ceil(hi - 1e-9)))
        d = need_d
        if d < current.decode:
            hi_d, _ = decode_need(load, cap, cfg, cfg.max_decode, scale=1 + BAND)
            d = max(d, min(current.decode, hi_d))
        desired = fit(p, d, cfg, need_p, need_d)
        if desired == current:
            return desired, "within_band"
        if desired != Split(max(p, cfg.min_prefill), max(d, cfg.min_decode)):
            return desired, "bounds"
        grow_p = desired.prefill != current.prefill
        grow_d = desired.decode != current.decode
        if grow_p and grow_d:
            return desired, f"{why_p}+{why_d}"
        return desired, why_p if grow_p else why_d

    def decide(self, signals: ClusterSignals, current: Split) -> Decision:
        load = self.observe(signals, current)
        if load is None:
            return Decision(signals.t, current, current, Action.HOLD, "no_data")
        desired, reason = self.target(load, signals, current)
        detail = (f"forecast rate={load.rate:.2f}/s in={load.input_tokens:.0f} "
                  f"out={load.output_tokens:.0f}")
        urgent = (action_of(current, desired) is Action.SCALE_UP
                  and ("queue_wait" in reason or "itl_measured" in reason))
        return self.gate(signals, current, desired, reason, detail, urgent)

    def gate(self, signals: ClusterSignals, current: Split, desired: Split, reason: str,
             detail: str, urgent: bool = False, shift_now: bool = True) -> Decision:
        """Keep a scale-down to what the window allows (stabilize.py); hold a change inside
        the cooldown, unless ``urgent`` (a target missed now, or a large predicted gain:
        waiting out the cooldown then costs more than a change undone); record when one is
        made."""
        t = signals.t
        kept = self.window.limit(t, current, desired, signals, shift_now)
        if kept != desired:
            if kept == current:
                return Decision(t, current, current, Action.HOLD, "stabilizing", detail)
            desired, reason = kept, f"{reason}+stabilizing"
        if desired != current and t - self.last_change < self.cfg.cooldown_s and not urgent:
            return Decision(t, current, current, Action.HOLD, "cooldown", detail)
        if desired != current:
            self.last_change = t
        return Decision(t, current, desired, action_of(current, desired), reason, detail)
