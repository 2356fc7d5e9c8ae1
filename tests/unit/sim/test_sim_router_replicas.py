"""router.replicas in the simulator: every replica sees the others' in-flight requests
(after sim.inflight_delay_s), so a burst spreads as with one router; nothing is left in
flight and every replica's index follows the same caches."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from services.common.config import ClusterConfig, parse_config
from services.sim.requests import SimRequest
from services.sim.simulator import Simulation
from services.steptime.model import MockStepModel


def config(*overrides: str) -> ClusterConfig:
    return parse_config({}, ["engine.runner=mock", "engine.num_kv_blocks=512",
                             "engine.mock.step_base_s=0.004",
                             "engine.mock.per_prefill_token_s=0.0002",
                             "engine.mock.per_decode_seq_s=0.0005",
                             "decode.replicas=4", "prefill.replicas=0", *overrides])


def burst() -> list[SimRequest]:
    """One request caches a 400-token prompt on a worker; 1 s later 16 more with that
    prompt arrive 5 ms apart (more than the default in-flight delay)."""
    rng = np.random.default_rng(0)
    prompt = tuple(int(x) for x in rng.integers(1000, 30000, 400))
    return [SimRequest(0, 0.0, len(prompt), 2, prompt=prompt)] + [
        SimRequest(i, 1 + 0.005 * i, len(prompt), 200, prompt=prompt) for i in range(1, 17)]


def run(cfg: ClusterConfig) -> tuple[Simulation, list[int]]:
    s = Simulation(cfg, burst(), MockStepModel.of(cfg.engine.mock), lambda r: list(r.prompt))
    result = s.run()
    assert all(r.completed for r in result.records)
    return s, sorted(Counter(r.worker for r in result.records[1:]).values())


@pytest.mark.parametrize("replicas", [2, 4])
def test_a_burst_spreads_across_replicas_as_with_one_router(replicas: int) -> None:
    _, one = run(config())
    s, many = run(config(f"router.replicas={replicas}"))
    # the worker holding the prompt takes requests until its load outweighs the hit
    assert one == [2, 2, 2, 10]
    assert many == one
    assert len(s.routers) == replicas and s.router is s.routers[0]
    # each replica routed its share, and every one counts every request while in flight
    for r in s.routers:
        assert r.load.inflight_count() == 0
        r.index.check_integrity()
        for w in s.decoders:
            assert r.index.num_blocks(w.id) == s.router.index.num_blocks(w.id)


def test_replicas_that_do_not_share_in_time_herd() -> None:
    # the control: adds reach the other replicas only after the burst
    _, counts = run(config("router.replicas=4", "sim.inflight_delay_s=5"))
    assert counts == [16]


def test_the_duration_ends_with_the_last_request_not_its_shared_free() -> None:
    one, _ = run(config())
    two, _ = run(config("router.replicas=2"))
    assert two.now == one.now


def test_fast_forward_gives_the_step_by_step_run_with_replicas() -> None:
    # shared updates reach routers only: they end no fast-forwarded run, and change nothing
    cfg = config("router.replicas=3")
    runs = []
    for ff in (True, False):
        s = Simulation(cfg, burst(), MockStepModel.of(cfg.engine.mock), lambda r: list(r.prompt),
                       fast_forward=ff)
        res = s.run()
        assert (res.fast_forward_steps > 0) == ff
        runs.append([(r.index, r.worker, r.cached_tokens, r.first_token_s, r.end_s, r.tokens_out)
                     for r in res.records])
    assert runs[0] == runs[1]
