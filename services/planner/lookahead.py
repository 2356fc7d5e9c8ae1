"""The simulate policy (``planner.policy: simulate``, the default): the formula's split and
its neighbours, each run forward from the cluster's state for ``lookahead_intervals``
intervals of forecast arrivals (services/planner/forward.py), the best predicted goodput
chosen; a tie goes to the fewest requests left waiting at the horizon, then to fewer
workers, then to the split that would serve the recent extreme loads best (the hedge,
``planner.hedge_window_s``), then to the split running now (no churn for nothing).

It changes the split only when the winner ranks above the split running now by those
coarse figures (goodput and waiting to ``MIN_GAIN``: no change for the model's noise); to
fewer workers only when they rank as well at ``1 + BAND`` times the forecast load (the
formula's band) and not below the formula's split for a role (its steady state: a few
intervals are shorter than a long request's life); and, as the formula, not inside the cooldown unless the gain predicted is
at least ``URGENT_GAIN``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from services.common.config import PlannerConfig
from services.planner.bounds import neighbours
from services.planner.capacity import Capacity
from services.planner.decision import Action, Decision, Split
from services.planner.forecast import Load
from services.planner.formula import BAND, MIN_BUSY_S, FormulaPolicy
from services.planner.forward import Prediction, Start, run_forward
from services.planner.signals import ClusterSignals, Role

MIN_GAIN = 0.02
# The fraction of requests within the targets that the p90 targets (planner.ttft_p90_s,
# itl_p90_s) ask for: a split predicted below it is overloaded.
ATTAINMENT = 0.9
# A predicted gain this large goes ahead inside the cooldown.
URGENT_GAIN = 0.2
# A tie leaves the split now for the hedge only at this much more goodput on the recent
# extremes (``_Hedge``): less is the model's noise, and a move costs a drain.
HEDGE_GAIN = 0.1
# ... and only if it ranks as well at this much more load (wider than the formula's BAND:
# at 1.25x a hedge into a long-prompt phase still swung 6P/2D -> 5P/3D -> 7P/1D).
HEDGE_BAND = 0.5


def start_of(signals: ClusterSignals, current: Split) -> Start:
    last = signals.last
    measured = (last.prefill_tokens_done / last.prefill_busy_s
                if last.prefill_busy_s >= MIN_BUSY_S and last.prefill_tokens_done else 0.0)
    decode = [w for w in signals.workers if w.role is Role.DECODE and w.ready]
    return Start(
        prefill_ready=signals.count(Role.PREFILL, ready_only=True),
        decode_ready=len(decode), current=current,
        queue_tokens=signals.prefill_queue_tokens, queue_jobs=signals.prefill_queue_jobs,
        queue_oldest_wait_s=signals.prefill_queue_oldest_wait_s,
        prefill_in_progress=sum(w.pending_prefill_tokens for w in signals.workers
                                if w.role is Role.PREFILL),
        local_pending=sum(w.pending_prefill_tokens for w in decode),
        running=sum(w.requests_running for w in decode),
        decode_tokens_left=sum(w.decode_tokens_left for w in decode),
        running_unbounded=sum(w.running_unbounded for w in decode),
        prefill_tok_s=measured)


def _rank(current: Split) -> Callable[[Prediction], tuple[float, float, int, bool]]:
    """Goodput (to MIN_GAIN: finer is the model's noise); then, where it ties (at 0 when
    every split is overloaded), the fewest requests left waiting at the horizon (to
    MIN_GAIN of those predicted), so an overload is worked off rather than settled into;
    then fewer workers; then the split now."""
    def key(p: Prediction) -> tuple[float, float, int, bool]:
        waiting = p.waiting / p.requests if p.requests else 0.0
        return (_coarse(p.goodput), -_coarse(waiting), -p.split.total, p.split == current)
    return key


def _shifts(split: Split, cfg: PlannerConfig) -> list[Split]:
    """The splits one worker away from ``split`` between the roles, within bounds: the
    hedge's steps, which the formula's neighbours may not hold."""
    return [s for s in neighbours(split, cfg)
            if s.total == split.total and s != split]


def _more(loads: list[Load], band: float) -> list[Load]:
    """``loads`` with ``1 + band`` times the arrivals: a band's test load."""
    return [Load(x.rate * (1 + band), x.input_tokens, x.output_tokens) for x in loads]


def _coarse(x: float) -> float:
    return round(x / MIN_GAIN) * MIN_GAIN


class SimulatePolicy:
    """Implements services.planner.policy.Policy; see the module docstring."""

    def __init__(self, cfg: PlannerConfig, cap: Capacity) -> None:
        self.cfg = cfg
        self.cap = cap
        self.formula = FormulaPolicy(cfg, cap)
        self.last: list[Prediction] = []  # the candidates of the last decision, for the log
        self.recent: deque[tuple[float, Load]] = deque()  # (t, the forecast's level)

    def decide(self, signals: ClusterSignals, current: Split) -> Decision:
        f = self.formula
        load = f.observe(signals, current)
        if load is None:
            return Decision(signals.t, current, current, Action.HOLD, "no_data")
        target, _ = f.target(load, signals, current)
        loads = [f.forecast.ahead(h) for h in range(1, self.cfg.lookahead_intervals + 1)]
        start = start_of(signals, current)
        extremes = self._extremes(signals.t, f.forecast.ahead(0))
        candidates = neighbours(target, self.cfg)
        for s in [current] + (_shifts(current, self.cfg) if extremes else []):
            if s not in candidates:
                candidates.append(s)
        preds = [run_forward(start, s, loads, self.cap, self.cfg) for s in candidates]
        self.last = preds
        now = next(p for p in preds if p.split == current)
        rank = _rank(current)
        best = max(preds, key=rank)
        detail = " ".join(f"{p.split.prefill}p{p.split.decode}d={p.goodput:.3f}" for p in preds)
        hedge = _Hedge(self, start, preds, rank, current, extremes, loads)
        if best.split == current:
            return hedge.or_hold(signals, "best_now", detail)
        b, n = rank(best), rank(now)
        reason = ("lookahead_goodput" if b[0] > n[0] else "lookahead_backlog" if b[1] > n[1]
                  else "lookahead_fewer")
        if reason == "lookahead_fewer":
            if _coarse(best.goodput) < ATTAINMENT:
                # every candidate misses the targets (with real processes the forward run
                # then predicted 0 for all, and the fewer-workers tie-break drained an
                # overloaded cluster to 1P/1D): fewer workers need a prediction that they
                # keep them
                return hedge.or_hold(signals, "overloaded", detail)
            # NOTE: a horizon of a few intervals is shorter than a long request's life: the
            # running population is still growing when it ends. Fewer workers than the
            # formula's steady state (Little's law) wait for a better prediction than a tie.
            if (best.split.prefill < min(target.prefill, current.prefill)
                    or best.split.decode < min(target.decode, current.decode)):
                return hedge.or_hold(signals, "steady_state", detail)
            # NOTE: the band: fewer workers only if they stay as good at 1 + BAND the load
            more = _more(loads, BAND)
            hi_best = rank(run_forward(start, best.split, more, self.cap, self.cfg))
            hi_now = rank(run_forward(start, current, more, self.cap, self.cfg))
            if hi_best[:2] < hi_now[:2]:
                return hedge.or_hold(signals, "within_band", detail)
        else:
            best = hedge.among(best)
        urgent = best.goodput - now.goodput >= URGENT_GAIN
        # NOTE: a move between roles that only the fewer-workers tie-break chose waits out
        # the window: with real processes the forward run often predicts every candidate the
        # same, and its tie-breaks then swung whole roles (4P/4D -> 2P/6D -> 6P/2D -> 7P/1D
        # -> 3P/5D -> 1P/7D in three minutes, benchmarks/planner_live.py). One predicted to
        # leave fewer requests waiting goes at once: held, a prompt surge (every split near
        # 0) waited a window for its prefill workers (tandem sim planner-eval's grid).
        return f.gate(signals, current, best.split, reason, detail + hedge.detail, urgent,
                      shift_now=reason != "lookahead_fewer")

    def _extremes(self, t: float, level: Load) -> list[Load]:
        """Remember ``level`` (this interval's forecast level); the loads of the last
        ``hedge_window_s`` with the most prompt tokens and the most output tokens per second
        (one if they are the same, none when the hedge is off)."""
        if self.cfg.hedge_window_s <= 0:
            return []
        self.recent.append((t, level))
        while t - self.recent[0][0] > self.cfg.hedge_window_s:
            self.recent.popleft()
        loads = [x for _, x in self.recent]
        p = max(loads, key=lambda x: x.rate * x.input_tokens)
        d = max(loads, key=lambda x: x.rate * x.output_tokens)
        return [p] if p == d else [p, d]

    def _hold(self, signals: ClusterSignals, current: Split, reason: str, detail: str) -> Decision:
        """A hold the lookahead chose: the split now is this interval's recommendation, which
        the scale-down window counts as the gate's are counted."""
        self.formula.window.record(signals.t, current, current)
        return Decision(signals.t, current, current, Action.HOLD, reason, detail)


class _Hedge:
    """The hedge (``planner.hedge_window_s``): among candidates the lookahead ranks the same
    (goodput, requests waiting, workers), the one with the best goodput on the worst of the
    recent extremes (``SimulatePolicy._extremes``, each held for the lookahead's
    intervals). A load that swung from long outputs to long prompts may swing back, and a
    split of all prefill then meets it with one decode worker (``tandem sim planner-eval``'s
    60-s phases). The split now keeps a tie unless another hedges ``HEDGE_GAIN`` better."""

    def __init__(self, policy: SimulatePolicy, start: Start, preds: list[Prediction],
                 rank: Callable[[Prediction], tuple[float, float, int, bool]], current: Split,
                 extremes: list[Load], loads: list[Load]) -> None:
        self.policy, self.start, self.preds, self.rank = policy, start, preds, rank
        self.loads = loads
        self.current, self.extremes = current, extremes
        self.score: dict[Split, float] = {}
        self.detail = ""

    def among(self, best: Prediction) -> Prediction:
        """The hedge's pick of the candidates tied with ``best``."""
        key = self.rank(best)[:3]
        tied = [p for p in self.preds if self.rank(p)[:3] == key]
        if len(tied) < 2 or not self.extremes:
            return best
        cfg, cap = self.policy.cfg, self.policy.cap
        h = cfg.lookahead_intervals
        for p in tied:
            if p.split not in self.score:
                self.score[p.split] = min(
                    _coarse(run_forward(self.start, p.split, [x] * h, cap, cfg).goodput)
                    for x in self.extremes)
        self.detail = " hedge " + " ".join(f"{s.prefill}p{s.decode}d={g:.2f}"
                                           for s, g in self.score.items())
        now = next((p for p in tied if p.split == self.current), None)
        ref = now if now is not None else best
        gain = HEDGE_GAIN if now is not None else 0.0
        # NOTE: a band, as for fewer workers: a split that ties only at the load forecast
        # (a horizon of a few intervals hides a queue that grows slowly) swung 6P/2D ->
        # 5P/3D -> 6P/2D within a long prompt phase; the hedge's pick must rank as well at
        # 1 + HEDGE_BAND times the load.
        more = _more(self.loads, HEDGE_BAND)
        ref_banded: tuple[float, float] | None = None
        for p in sorted(tied, key=lambda p: (-self.score[p.split], p.split != ref.split)):
            if p.split == ref.split or self.score[p.split] < self.score[ref.split] + gain:
                break
            if ref_banded is None:
                ref_banded = self.rank(run_forward(self.start, ref.split, more, cap, cfg))[:2]
            if self.rank(run_forward(self.start, p.split, more, cap, cfg))[:2] >= ref_banded:
                return p
        return ref

    def or_hold(self, signals: ClusterSignals, reason: str, detail: str) -> Decision:
        """The hedge's move from the split now, if one ties with it and hedges better; else
        the hold ``reason``."""
        now = next(p for p in self.preds if p.split == self.current)
        pick = self.among(now)
        f = self.policy.formula
        if pick.split == self.current:
            return self.policy._hold(signals, self.current, reason, detail + self.detail)
        return f.gate(signals, self.current, pick.split, "lookahead_hedge",
                      detail + self.detail)
