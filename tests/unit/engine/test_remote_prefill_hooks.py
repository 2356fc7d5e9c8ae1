"""Disaggregation hooks: export on a prefill engine, park/import/decode on a decode engine."""

from __future__ import annotations

import pytest
import torch

from services.api.kv_events import KvStored
from services.api.outputs import FinishReason, TokenOutput
from services.api.sampling import SamplingParams
from services.common.hashing import block_hashes
from services.engine.block_pool import BlockPool
from services.engine.engine import LLMEngine
from services.engine.kv_cache_manager import KvCacheManager
from services.engine.remote_prefill import RemoteKvError
from services.engine.request import GenerateRequest
from services.engine.runner.mock_runner import MockRunner
from services.engine.scheduler import Scheduler
from tests.support.engine_factory import make_engine, mock_cfg, oracle, req, run_all

BASE = list(range(100, 114))  # 14 tokens: blocks 0..2 full, block 3 holds 2


def prefill_remotely(prompt: list[int], from_block: int, rid: str = "x") -> TokenOutput:
    """Run the prompt on a fresh prefill engine, exporting blocks [from_block, ...)."""
    p, _, _ = make_engine(worker_id="p")
    p.add_request(GenerateRequest(rid, prompt, SamplingParams(max_tokens=1),
                                  export_kv_from_block=from_block))
    outs: list[TokenOutput] = []
    while p.has_unfinished():
        outs += p.step()
    p.check_integrity()
    assert p.stats().kv_blocks_used == 0  # exported before its blocks were freed, then freed
    (final,) = outs
    assert final.finished and final.kv is not None
    return final


def decode_engine_with_shared_prefix() -> tuple[LLMEngine, MockRunner, list]:
    d, runner, events = make_engine(worker_id="d")
    d.add_request(req("warm", BASE[:8] + [5, 5, 5], max_tokens=1))  # caches blocks 0, 1
    run_all(d)
    events.clear()
    return d, runner, events


def collect(eng: LLMEngine, first: TokenOutput | None, rid: str = "x") -> list[int]:
    toks = list(first.token_ids) if first else []
    toks += run_all(eng).get(rid, [])
    return toks


def test_export_then_import_transfers_only_missing_blocks_and_matches_a_local_run() -> None:
    d, runner, events = decode_engine_with_shared_prefix()
    r = req("x", BASE, max_tokens=6)
    handle = d.begin_remote_prefill(r)
    assert handle is not None
    assert (handle.num_cached_tokens, handle.first_block_to_fill, handle.num_blocks_to_fill) == (8, 2, 2)
    assert d.stats().num_parked == 1 and not d.has_schedulable()
    assert d.step() == [] and d.last_batch_size == 0  # parked: never scheduled
    final = prefill_remotely(BASE, handle.first_block_to_fill)
    assert final.kv.shape == (1, 2, 2, 4, 1, 1) and final.kv.dtype == torch.float32
    # the exported K holds the prompt tokens of blocks 2 and 3 (block 3 partially)
    assert final.kv[0, 0, :, :, 0, 0].flatten()[:6].tolist() == BASE[8:]
    first = d.complete_remote_prefill("x", final.kv, final.token_ids[0])
    assert first is not None and first.num_cached_tokens == 8 and not first.finished
    stored = [e for e in events if isinstance(e, KvStored)]
    assert len(stored[0].blocks) == 1  # imported block 2 is full; block 3 is partial
    hashes = block_hashes(BASE, 4)
    assert stored[0].parent_seq_hash == hashes[1].seq_hash  # chained after the local hits
    assert stored[0].blocks[0].seq_hash == hashes[2].seq_hash
    want, _ = oracle(d, runner, r)
    assert collect(d, first) == want
    assert d.stats().kv_blocks_used == 0
    d.check_integrity()


def test_bad_kv_raises_clearly_and_falls_back_to_local_without_leaking() -> None:
    d, runner, _ = decode_engine_with_shared_prefix()
    r = req("x", BASE, max_tokens=4)
    handle = d.begin_remote_prefill(r)
    assert handle is not None
    wrong_count = torch.zeros(1, 2, 3, 4, 1, 1)
    with pytest.raises(RemoteKvError, match=r"shape \(1, 2, 3, 4, 1, 1\) != expected \(1, 2, 2, 4, 1, 1\)"):
        d.complete_remote_prefill("x", wrong_count, 7)
    d.check_integrity()
    assert d.stats().num_parked == 0 and d.scheduler.seqs["x"].block_table  # kept its hits
    assert collect(d, None) == oracle(d, runner, r)[0]
    # and a wrong dtype, on a second request
    r2 = req("y", BASE[:6] + [9] * 6, max_tokens=2)
    h2 = d.begin_remote_prefill(r2)
    assert h2 is not None
    with pytest.raises(RemoteKvError, match="dtype"):
        d.complete_remote_prefill("y", torch.zeros(1, 2, h2.num_blocks_to_fill, 4, 1, 1,
                                                   dtype=torch.float64), 7)
    assert run_all(d)["y"] == oracle(d, runner, r2)[0]
    assert d.stats().kv_blocks_used == 0
    d.check_integrity()


def test_fail_falls_back_to_local_prefill_keeping_prefix_hits() -> None:
    d, runner, _ = decode_engine_with_shared_prefix()
    r = req("x", BASE, max_tokens=5)
    assert d.begin_remote_prefill(r) is not None
    assert d.fail_remote_prefill("x") is True
    seq = d.scheduler.seqs["x"]
    assert len(seq.block_table) == 2 and seq.num_computed_tokens == 8
    assert d.fail_remote_prefill("x") is False
    assert collect(d, None) == oracle(d, runner, r)[0]
    assert d.stats().prefix_cache_hit_tokens_total == 8
    d.check_integrity()


def test_duplicate_completion_is_ignored() -> None:
    d, runner, _ = decode_engine_with_shared_prefix()
    r = req("x", BASE, max_tokens=3)
    handle = d.begin_remote_prefill(r)
    final = prefill_remotely(BASE, handle.first_block_to_fill)
    first = d.complete_remote_prefill("x", final.kv, final.token_ids[0])
    assert d.complete_remote_prefill("x", final.kv, final.token_ids[0]) is None
    assert collect(d, first) == oracle(d, runner, r)[0]
    assert d.complete_remote_prefill("x", final.kv, final.token_ids[0]) is None
    d.check_integrity()


def test_first_token_can_finish_the_request() -> None:
    d, _, _ = decode_engine_with_shared_prefix()
    handle = d.begin_remote_prefill(req("x", BASE, max_tokens=1))
    final = prefill_remotely(BASE, handle.first_block_to_fill)
    first = d.complete_remote_prefill("x", final.kv, final.token_ids[0])
    assert first.finished and first.finish_reason is FinishReason.LENGTH
    assert not d.has_unfinished() and d.stats().kv_blocks_used == 0
    d.check_integrity()


def test_abort_while_parked_frees_blocks_and_late_completion_is_ignored() -> None:
    d, _, _ = decode_engine_with_shared_prefix()
    handle = d.begin_remote_prefill(req("x", BASE))
    assert d.stats().kv_blocks_used == 4
    out = d.abort("x")
    assert out.finish_reason is FinishReason.ABORT
    assert d.stats().kv_blocks_used == 0
    final = prefill_remotely(BASE, handle.first_block_to_fill)
    assert d.complete_remote_prefill("x", final.kv, final.token_ids[0]) is None
    d.check_integrity()


def test_begin_returns_none_when_the_blocks_do_not_fit() -> None:
    d, _, _ = make_engine(mock_cfg(num_kv_blocks=6))
    assert d.begin_remote_prefill(req("a", list(range(16)))) is not None  # 4 blocks
    assert d.begin_remote_prefill(req("b", list(range(50, 66)))) is None  # needs 4, 2 left
    assert "b" not in d.scheduler.seqs
    d.abort("a")
    assert d.stats().kv_blocks_used == 0
    d.check_integrity()


def test_a_scheduler_without_a_kv_importer_refuses_to_park() -> None:
    sched = Scheduler(KvCacheManager(BlockPool(8, 4)), max_num_seqs=2, max_num_batched_tokens=8,
                      max_model_len=32, vocab_size=1000, eos_token_ids=[2])
    with pytest.raises(RuntimeError, match="kv_importer"):
        sched.begin_remote_prefill(req("x", BASE))
    assert not sched.has_unfinished() and sched.kv.pool.num_used == 0
