"""The ttft policy: predictions from the step model, the choice, and the per-worker
correction from first-token reports."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Histogram

from services.api.route import RequestPhase, RouteRequest
from services.api.wire import WorkerLoad
from services.common.config import parse_config
from services.common.discovery import Registration
from services.router.router import Router
from services.router.ttft import (
    KV_FULL_PENALTY_S,
    MIN_WORKER_SAMPLES,
    TtftCandidate,
    TtftPredictor,
    select_by_ttft,
)
from services.steptime.model import BatchShape, MockStepModel
from services.steptime.predict import prefill_seconds

MODEL = MockStepModel(step_base_s=0.01, per_prefill_token_s=1e-4, per_decode_seq_s=1e-3)
BS = 16


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def predictor(clock: Clock | None = None, alpha: float = 0.5) -> TtftPredictor:
    return TtftPredictor(MODEL, BS, 512, alpha, clock or Clock(), keep_errors=True)


def test_a_prediction_is_the_queued_and_uncached_prefill_beside_the_running_decodes() -> None:
    p = predictor()
    c = TtftCandidate("w", overlap_blocks=10, pending_prefill_blocks=20, active_blocks=40,
                      running=3, free_blocks=1000)
    want = (prefill_seconds(MODEL, (20 + 50 - 10) * BS, 512, 10 * BS, 3, 40 * BS)
            + MODEL.step_seconds(BatchShape(decode_seqs=3, decode_context=40 * BS)))
    assert p.predict(c, 50) == pytest.approx(want)
    assert p.predict(c._replace(running=0), 50) < want
    assert p.predict(c._replace(free_blocks=39), 50) >= KV_FULL_PENALTY_S  # 40 uncached


def test_the_fastest_wins_and_a_near_tie_goes_to_the_cache() -> None:
    p, rng = predictor(), random.Random(0)
    idle = TtftCandidate("idle", 0, 0, 0, 0, -1)
    cached = TtftCandidate("cached", 30, 0, 0, 0, -1)
    busy_cached = TtftCandidate("busy", 30, 200, 0, 8, -1)
    assert select_by_ttft(p, [idle, cached, busy_cached], 32, 0.0, rng).worker_id == "cached"
    assert select_by_ttft(p, [idle, busy_cached], 32, 0.0, rng).worker_id == "idle"
    # 2 of 32 blocks cached: a few ms sooner than the idle one, inside a 50% band
    slight = TtftCandidate("slight", 2, 0, 0, 0, -1)
    assert select_by_ttft(p, [idle, slight], 32, 0.5, rng).worker_id == "slight"
    warm = TtftCandidate("warm", 32, 40, 0, 0, -1)  # all cached, but 640 tokens queued
    assert select_by_ttft(p, [slight, warm], 32, 0.0, rng).worker_id == "slight"
    assert select_by_ttft(p, [slight, warm], 32, 0.5, rng).worker_id == "warm"
    with pytest.raises(ValueError):
        select_by_ttft(p, [], 1, 0.0, rng)


def test_first_token_reports_correct_the_workers_bias_and_record_the_error() -> None:
    clock = Clock()
    reg = CollectorRegistry()
    err = Histogram("e", "e", registry=reg, buckets=(0.01, 0.1, 1))
    p = TtftPredictor(MODEL, BS, 512, 0.5, clock, err, keep_errors=True)
    c, other = TtftCandidate("w", 0, 0, 0, 0, -1), TtftCandidate("v", 0, 0, 0, 0, -1)
    base = p.predict(c, 4)
    n = MIN_WORKER_SAMPLES + 4
    for i in range(n):  # the worker is always 0.2 s slower than modelled
        p.routed(f"r{i}", "w", p.predict(c, 4))
        clock.now += base + 0.2
        p.first_token(f"r{i}")
        if i + 1 < MIN_WORKER_SAMPLES:  # too few reports: the cluster's bias, for every worker
            assert "w" not in p.bias and p.predict(c, 4) == p.predict(other, 4)
    assert p.bias["w"] == pytest.approx(0.2, rel=1e-3)
    assert p.predict(c, 4) == pytest.approx(base + 0.2, rel=1e-3)
    assert p.errors is not None and len(p.errors) == n
    assert abs(p.errors[-1][1] - p.errors[-1][0]) < 0.001 < abs(p.errors[0][1] - p.errors[0][0])
    assert reg.get_sample_value("e_count") == n
    p.routed("gone", "w", 1.0)
    p.forget("gone")
    p.first_token("gone")  # aborted before its first token: nothing learnt
    assert len(p.errors) == n
    p.worker_left("w")
    assert "w" not in p.bias


async def test_the_router_in_ttft_mode_avoids_a_busy_worker_and_learns_from_reports() -> None:
    clock = Clock()
    cfg = parse_config({"router": {"mode": "ttft", "ttft_bias_alpha": 0.05},
                        "engine": {"runner": "mock", "block_size": BS}})
    router = Router(cfg, seed=0, clock=clock, keep_ttft_errors=True)
    for w in ("a", "b"):
        router.worker_joined(Registration("decode", w, address=f"{w}:1"))
    router.apply_load(WorkerLoad("a", 10, 1000, 4, 6, 6000, 0.0))  # 6000 tokens to prefill
    router.apply_load(WorkerLoad("b", 10, 1000, 4, 0, 0, 0.0))
    r = await router.route(RouteRequest("r1", list(range(64))))
    assert r.worker_id == "b"
    clock.now = 0.5
    await router.update("r1", RequestPhase.PREFILLED)
    assert router.ttft is not None and router.ttft.errors and router.ttft.errors[0][1] == 0.5
    assert router.ttft.cluster_bias > 0 and "b" not in router.ttft.bias  # one report: too few
    await router.update("r1", RequestPhase.FINISHED)
    assert router.load.inflight_count() == 0
    assert router.metrics.registry.get_sample_value(
        "tandem_router_ttft_prediction_error_seconds_count") == 1
