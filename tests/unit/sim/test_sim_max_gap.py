"""Each request's largest inter-token gap (``RequestRecord.max_gap_s``, what the goodput
rule's ``itl_ms`` checks): the same whether decode runs are fast-forwarded or stepped."""

from __future__ import annotations

from services.common.config import ClusterConfig
from services.sim.records import SimResult
from services.sim.requests import SimRequest
from services.sim.simulator import simulate
from services.steptime.model import MockStepModel


def _tokens(r: SimRequest) -> list[int]:
    return [(r.index * 31 + j) % 1000 + 5 for j in range(r.input_len)]


def _run(fast_forward: bool) -> SimResult:
    cfg = ClusterConfig.model_validate({"decode": {"replicas": 2}, "prefill": {"replicas": 0}})
    # Arrivals while others decode: runs are cut short and batches change size.
    reqs = [SimRequest(i, i * 0.05, 40 + 7 * i, 20 + 3 * i) for i in range(12)]
    return simulate(cfg, reqs, MockStepModel.of(cfg.engine.mock), _tokens,
                    fast_forward=fast_forward)


def test_max_gap_is_the_same_fast_forwarded_or_stepped() -> None:
    fast, slow = _run(True), _run(False)
    assert fast.fast_forward_steps > 0 and slow.fast_forward_steps == 0
    assert [r.max_gap_s for r in fast.records] == [r.max_gap_s for r in slow.records]


def test_max_gap_bounds_the_mean_gap_and_the_pooled_gaps() -> None:
    res = _run(True)
    assert all(r.completed and r.tokens_out > 1 for r in res.records)
    for r in res.records:
        tpot = r.tpot_s
        assert tpot is not None and r.max_gap_s >= tpot - 1e-12
    assert max(r.max_gap_s for r in res.records) == max(res.gaps.values)
