"""Workers joining and leaving a simulated cluster mid-run: no request lost or failed, no
KV block left on a drained worker, moved requests finish with all their tokens."""

from __future__ import annotations

import numpy as np
import pytest

from services.common.config import ClusterConfig, parse_config
from services.sim.requests import SimRequest
from services.sim.simulator import Simulation
from services.steptime.model import MockStepModel


def workload(n: int = 150, rate: float = 8.0, seed: int = 1) -> list[SimRequest]:
    rng = np.random.default_rng(seed)
    t, out = 0.0, []
    for i in range(n):
        t += float(rng.exponential(1 / rate))
        prompt = tuple(int(x) for x in rng.integers(1000, 30000, int(rng.choice([40, 600]))))
        out.append(SimRequest(i, t, len(prompt), int(rng.integers(20, 200)), prompt=prompt))
    return out


def config(*overrides: str) -> ClusterConfig:
    return parse_config({}, ["engine.runner=mock", "engine.num_kv_blocks=1024",
                             "engine.mock.step_base_s=0.004",
                             "engine.mock.per_prefill_token_s=0.0002",
                             "engine.mock.per_decode_seq_s=0.0005",
                             "decode.disagg.enabled=true",
                             "decode.disagg.max_local_prefill_length=256", *overrides])


def sim(cfg: ClusterConfig, reqs: list[SimRequest], fast_forward: bool = True) -> Simulation:
    return Simulation(cfg, reqs, MockStepModel.of(cfg.engine.mock), lambda r: list(r.prompt),
                      fast_forward=fast_forward)


def check_clean(s: Simulation, n: int) -> None:
    result = s.run()
    assert len(result.records) == n
    assert all(r.completed and r.error is None for r in result.records)
    assert all(r.tokens_out == r.output_tokens for r in result.records)
    assert s.leaked_blocks == 0
    for w in s.decoders + s.prefillers + s.gone:
        assert w.engine.pool.num_used == 0
        w.engine.check_integrity()
    assert not s.leaving and not s.starting


@pytest.mark.parametrize("fast_forward", [True, False])
def test_decode_worker_drained_mid_run_moves_its_requests(fast_forward: bool) -> None:
    reqs = workload()
    s = sim(config("decode.replicas=3", "prefill.replicas=1"), reqs, fast_forward)
    live: list[str] = []

    def drain() -> None:
        w = s.by_id["decode-1"]
        live.extend(q.request_id for q in w.engine.scheduler.running)
        assert s.drain_worker("decode-1")

    s.at(6.0, drain)
    check_clean(s, len(reqs))
    assert [w.id for w in s.gone] == ["decode-1"]
    assert live and set(live) <= s.moved
    # every request it held ended elsewhere, with all its tokens (check_clean)
    assert all(s.records[rid].worker != "decode-1" for rid in live)
    assert not s.reprefilled


def test_prefill_worker_drained_finishes_its_jobs() -> None:
    reqs = workload()
    s = sim(config("decode.replicas=2", "prefill.replicas=2"), reqs)
    s.at(5.0, lambda: s.drain_worker("prefill-0"))
    check_clean(s, len(reqs))
    assert [w.id for w in s.gone] == ["prefill-0"]
    late = [r for r in s.records.values() if r.remote and r.sent_s > 8.0]
    assert late and all(r.prefill_worker == "prefill-1" for r in late)


def test_workers_join_after_their_ready_time() -> None:
    reqs = workload()
    s = sim(config("decode.replicas=1", "prefill.replicas=0"), reqs)
    ids: list[str] = []
    s.at(2.0, lambda: ids.extend([s.add_worker("decode", 3.0), s.add_worker("prefill", 3.0)]))
    check_clean(s, len(reqs))
    assert ids == ["decode-1", "prefill-0"]
    recs = list(s.records.values())
    assert all(r.worker == "decode-0" for r in recs if r.sent_s < 5.0)
    assert any(r.worker == "decode-1" for r in recs if r.sent_s > 5.5)
    assert any(r.prefill_worker == "prefill-0" for r in recs if r.sent_s > 5.5)
    assert not any(r.remote for r in recs if r.sent_s < 5.0)


def test_last_decode_worker_is_not_drained() -> None:
    s = sim(config("decode.replicas=1"), workload(10))
    assert s.drain_worker("decode-0") is False
    check_clean(s, 10)


def test_join_and_leave_together_is_deterministic() -> None:
    def once() -> list[tuple]:
        reqs = workload(120)
        s = sim(config("decode.replicas=2", "prefill.replicas=1"), reqs)
        s.at(3.0, lambda: s.add_worker("decode", 2.0))
        s.at(7.0, lambda: s.drain_worker("decode-0"))
        s.at(7.0, lambda: s.drain_worker("prefill-0"))
        res = s.run()
        assert all(r.completed for r in res.records) and s.leaked_blocks == 0
        return [(r.worker, r.first_token_s, r.end_s, r.tokens_out) for r in res.records]
    assert once() == once()


def test_moved_twice_while_prefilled_again_keeps_every_token() -> None:
    """A pool too small for the moved KV: the target prefills the request again (in chunks);
    draining that target at once waits for the prefill before moving the request on: every
    move takes a sequence whose KV is computed up to its last streamed token."""
    reqs = workload(200, rate=20.0)
    s = sim(config("decode.replicas=3", "prefill.replicas=1", "engine.num_kv_blocks=100",
                   "engine.max_num_batched_tokens=128"), reqs)
    moves: list[tuple[str, int, int]] = []
    second: list[str] = []
    move_out, move_in = s._move_out, s._move_in

    def out(w, seq):  # type: ignore[no-untyped-def]
        moves.append((seq.request_id, seq.num_computed_tokens, len(seq.token_ids)))
        move_out(w, seq)

    def into(w, rid, tokens, remaining):  # type: ignore[no-untyped-def]
        move_in(w, rid, tokens, remaining)
        if rid in s.reprefilled and not second:
            second.append(w.id)
            s.at(s.now, lambda: s.drain_worker(w.id))

    s._move_out, s._move_in = out, into  # type: ignore[method-assign]
    s.at(6.0, lambda: s.drain_worker("decode-1"))
    check_clean(s, len(reqs))
    assert second, "no move was prefilled again: the pool is not small enough"
    twice = {rid for rid, _, _ in moves if [m[0] for m in moves].count(rid) > 1}
    assert twice
    assert all(computed == n - 1 for _, computed, n in moves)
