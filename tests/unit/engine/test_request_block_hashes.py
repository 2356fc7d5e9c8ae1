"""GenerateRequest.block_hashes: a prompt hashed by the caller (to route it) is not hashed
again, and the engine behaves exactly as when it hashes the prompt itself."""

from __future__ import annotations

from dataclasses import replace

import pytest

from services.common.hashing import block_hashes
from services.engine.request import GenerateRequest
from services.engine.scheduler import InvalidRequestError
from tests.support.engine_factory import make_engine, mock_cfg, req, run_all

BS = 4
SHARED = list(range(100, 110))  # two full blocks and a partial one


def _requests(hashed: bool) -> list[GenerateRequest]:
    out = []
    for i, tail in enumerate(([7, 8, 9], [5, 6, 7, 8, 9, 10])):
        r = req(f"r{i}", SHARED + tail, max_tokens=6)
        out.append(replace(r, block_hashes=block_hashes(r.prompt_token_ids, BS)) if hashed else r)
    return out


def test_given_hashes_seed_the_sequence_and_change_nothing_else() -> None:
    results = []
    for hashed in (False, True):
        eng, _, events = make_engine(mock_cfg(block_size=BS))
        first, second = _requests(hashed)
        eng.add_request(first)
        got = run_all(eng)
        eng.add_request(second)
        if hashed:  # seeded, not recomputed: the very objects the caller made
            seq = eng.scheduler.seqs["r1"]
            assert seq.block_hashes == list(second.block_hashes or ())
            assert all(a is b for a, b in zip(seq.block_hashes, second.block_hashes or (), strict=True))
        got |= run_all(eng)
        eng.check_integrity()
        results.append((got, events, eng.stats().prefix_cache_hit_tokens_total))
    assert results[0] == results[1]
    assert results[1][2] == 8  # the second prompt hit the two shared blocks


def test_validate_rejects_a_count_that_is_not_the_prompts_full_blocks() -> None:
    eng, _, _ = make_engine(mock_cfg(block_size=BS))
    r = req("r", SHARED)
    eng.validate(replace(r, block_hashes=block_hashes(SHARED, BS)))
    for wrong in (block_hashes(SHARED[:4], BS), block_hashes(SHARED + [1, 2], BS)):
        with pytest.raises(InvalidRequestError, match="block_hashes for a prompt of 2 full blocks"):
            eng.validate(replace(r, block_hashes=wrong))
