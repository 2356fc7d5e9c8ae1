"""The kv cost's eviction term: a request whose prefill would push cached blocks out of a
full worker goes to a worker with room unless the prefix it shares is worth more."""

from __future__ import annotations

import random

from services.api.route import RouteRequest
from services.api.wire import WorkerLoad
from services.common.config import parse_config
from services.common.discovery import Registration
from services.common.hashing import local_block_hashes, seq_hashes
from services.router.router import Router
from services.router.selection import Candidate, cost, select_worker
from services.router.ttft import TtftCandidate, TtftPredictor, select_by_ttft
from services.steptime.model import MockStepModel


def test_cost_prices_evicted_blocks_after_the_queued_prefills() -> None:
    # 10 blocks, 2 cached: 8 to write; 5 unused blocks, 3 of them taken by queued prefills
    c = Candidate("w", overlap_blocks=2, pending_prefill_blocks=3, active_blocks=0, unused_blocks=5)
    # prefill = 8 + 3 = 11; evicted = 8 - (5 - 3) = 6; decode = 0 + 10
    assert cost(c, 10, overlap_weight=4.0, eviction_weight=0.5) == 4.0 * (11 + 0.5 * 6) + 10
    assert cost(c, 10, 4.0) == 4.0 * 11 + 10  # weight 0: no term
    # room for all of it: nothing evicted; unknown room (-1): nothing assumed evicted
    assert cost(c._replace(unused_blocks=20), 10, 4.0, 0.5) == cost(c, 10, 4.0)
    assert cost(c._replace(unused_blocks=-1), 10, 4.0, 0.5) == cost(c, 10, 4.0)


def test_a_new_conversation_goes_where_it_evicts_nothing() -> None:
    """The case the cost without the term got wrong: every prompt starts with the same
    system-prompt block. A worker that served conversations caches it and is full; a worker
    that never served one does not, and its cache is empty. Without the term the shared block
    wins and the new conversation evicts an earlier one's turns."""
    rng = random.Random(0)
    full = Candidate("full", overlap_blocks=8, pending_prefill_blocks=0, active_blocks=0,
                     unused_blocks=0)
    empty = Candidate("empty", overlap_blocks=0, pending_prefill_blocks=0, active_blocks=0,
                      unused_blocks=16384)
    assert select_worker([full, empty], 200, 4.0, 0.0, rng).worker_id == "full"
    assert select_worker([full, empty], 200, 4.0, 0.0, rng, eviction_weight=0.5).worker_id == "empty"
    # a later turn whose whole prefix the full worker holds stays there
    turn = full._replace(overlap_blocks=190)
    assert select_worker([turn, empty], 200, 4.0, 0.0, rng, eviction_weight=0.5).worker_id == "full"


def _store(router: Router, worker: str, tokens: list[int], bs: int) -> None:
    local = local_block_hashes(tokens, bs)
    router.index.apply_stored(worker, None, seq_hashes(local), local)


async def test_the_router_reads_room_from_the_index_and_the_load_sample() -> None:
    bs = 4
    cfg = parse_config({"engine": {"block_size": bs}, "router": {"mode": "kv"}})
    assert cfg.router.eviction_weight > 0  # the default prices evictions
    router = Router(cfg, seed=0)
    for w in ("used", "fresh"):
        router.worker_joined(Registration("decode", w, address=f"{w}:1"))
    system = list(range(bs))  # one shared block
    # "used" caches the system prompt and an earlier conversation: 10 of its 10 blocks
    _store(router, "used", system + list(range(100, 100 + 9 * bs)), bs)
    for w in ("used", "fresh"):
        router.apply_load(WorkerLoad(w, 0, 10, 0, 0, 0, 0.0))
    prompt = system + list(range(500, 500 + 5 * bs))  # 6 blocks, the first shared
    assert (await router.route(RouteRequest("new", prompt))).worker_id == "fresh"
    off = parse_config({"engine": {"block_size": bs},
                        "router": {"mode": "kv", "eviction_weight": 0}})
    old = Router(off, seed=0)
    for w in ("used", "fresh"):
        old.worker_joined(Registration("decode", w, address=f"{w}:1"))
        old.apply_load(WorkerLoad(w, 0, 10, 0, 0, 0, 0.0))
    _store(old, "used", system + list(range(100, 100 + 9 * bs)), bs)
    assert (await old.route(RouteRequest("new", prompt))).worker_id == "used"


def test_ttft_ranks_a_full_cache_behind_an_empty_one_but_reports_the_prediction() -> None:
    """The same case under the ttft policy: the full worker's first token is a few ms sooner
    (8 blocks cached), but its prefill would evict 192 cached blocks."""
    model = MockStepModel(step_base_s=0.01, per_prefill_token_s=2e-5, per_decode_seq_s=2e-4)
    p = TtftPredictor(model, 64, 8192, 0.0, lambda: 0.0)
    rng = random.Random(0)
    full = TtftCandidate("full", 8, 0, 0, 0, free_blocks=16384, unused_blocks=0)
    empty = TtftCandidate("empty", 0, 0, 0, 0, free_blocks=16384, unused_blocks=16384)
    assert p.predict(full, 200) < p.predict(empty, 200)
    assert select_by_ttft(p, [full, empty], 200, 0.0, rng).worker_id == "full"
    s = select_by_ttft(p, [full, empty], 200, 0.0, rng, eviction_weight=0.5)
    assert s.worker_id == "empty" and s.predicted_s == p.predict(empty, 200)
    # a later turn of a conversation the full worker holds stays there
    turn = full._replace(overlap_blocks=190)
    assert select_by_ttft(p, [turn, empty], 200, 0.0, rng, eviction_weight=0.5).worker_id == "full"
