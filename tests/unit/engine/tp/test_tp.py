"""Tensor parallelism: a model split 2, 3 or 4 ways over rank processes computes the same
logits as the unsplit model (float32, within 1e-4), and an engine on it generates the same
greedy tokens over mixed batches with prefix hits, chunked prefill, preemption and aborts.
KV exported from / imported into a TP worker has the whole model's layout."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from services.common.config import EngineConfig
from services.engine.batch import ScheduledBatch
from services.engine.engine import LLMEngine
from services.engine.parallel.shard import check_tp_layout
from services.engine.request import GenerateRequest
from services.engine.runner.torch_runner import TorchRunner
from services.engine.tp.runner import TpRunner
from services.engine.weights import load_weights
from services.model.arch import ModelArchConfig
from tests.support.tiny_model import drive_mixed, mixed_workload, seq, tiny_hf_model


def _cfg(**kw) -> EngineConfig:
    base = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=64, tp_timeout_s=120)
    base.update(kw)
    return EngineConfig(**base)


@contextmanager
def _tp_runner(path: Path, cfg: EngineConfig) -> Iterator[TpRunner]:
    loaded = load_weights(path)
    runner = TpRunner(loaded.arch, loaded.tensors, cfg, path)
    try:
        yield runner
    finally:
        runner.close()


def _tiny(tmp_path: Path, arch: str) -> Path:
    model, _ = tiny_hf_model(arch, tie=False, seed=3)
    model.save_pretrained(tmp_path, safe_serialization=True)
    return tmp_path


def _batches(vocab: int) -> list[ScheduledBatch]:
    """A prefill of two prompts, then one continuing chunk beside a decode: every kind of row."""
    g = torch.Generator().manual_seed(0)
    a = torch.randint(3, vocab, (11,), generator=g).tolist()
    b = torch.randint(3, vocab, (6,), generator=g).tolist()
    first = ScheduledBatch([seq("a", a[:7], 0, [0, 1]), seq("b", b, 0, [4, 5])])
    second = ScheduledBatch([seq("a", a[7:], 7, [0, 1, 2]), seq("b", [5], 6, [4, 5])])
    return [first, second]


def _logits(runner: TorchRunner, batches: list[ScheduledBatch]) -> list[torch.Tensor]:
    for b in batches:  # the runner, not the engine, registers requests: do it by hand
        for s in b.seqs:
            if s.start_pos == 0:
                runner.request_added(GenerateRequest(s.request_id, s.token_ids))
    return [runner.logits_for(b) for b in batches]


def _with_owners(batches: list[ScheduledBatch]) -> list[ScheduledBatch]:
    """The TP step encoder reads each sequence's prompt length from its owner."""
    from services.engine.sequence import Sequence

    prompts = {}
    for b in batches:
        for s in b.seqs:
            if s.start_pos == 0:
                prompts[s.request_id] = Sequence.from_request(GenerateRequest(s.request_id, s.token_ids))
        b.owners = [prompts[s.request_id] for s in b.seqs]
    return batches


@pytest.mark.parametrize(("arch", "tp"), [("llama", 2), ("qwen2", 2), ("llama", 4)])
def test_tiny_logits_equal_unsplit(tmp_path: Path, arch: str, tp: int) -> None:
    # tp=4 on 2 KV heads replicates each KV head on two ranks.
    path = _tiny(tmp_path, arch)
    loaded = load_weights(path)
    want = _logits(TorchRunner(loaded.arch, loaded.tensors, _cfg()), _with_owners(_batches(128)))
    with _tp_runner(path, _cfg(tensor_parallel_size=tp)) as runner:
        got = _logits(runner, _with_owners(_batches(128)))
    # Read once the ranks have exited (close joins them): every rank ran both steps.
    stats = runner.rank_stats()
    assert [s.steps for s in stats] == [2] * tp
    assert all(s.all_reduce_seconds > 0 for s in stats)
    for w, g in zip(want, got, strict=True):
        assert w.shape == g.shape
        torch.testing.assert_close(g, w, atol=1e-4, rtol=0)


def test_smollm2_tp3_logits_equal_unsplit(smollm2_path: Path) -> None:
    # SmolLM2-135M: 9 query heads, 3 KV heads -> one KV head per rank.
    loaded = load_weights(smollm2_path)
    assert (loaded.arch.num_heads, loaded.arch.num_kv_heads) == (9, 3)
    cfg = _cfg(num_kv_blocks=16)
    want = _logits(TorchRunner(loaded.arch, loaded.tensors, cfg), _with_owners(_batches(1000)))
    with _tp_runner(smollm2_path, _cfg(num_kv_blocks=16, tensor_parallel_size=3)) as runner:
        assert runner.kv_cache.shape[4] == 1  # this rank's KV-head slice only
        got = _logits(runner, _with_owners(_batches(1000)))
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=0)


def _drive(engine: LLMEngine, vocab: int = 128) -> dict[str, list[int]]:
    return drive_mixed(engine, mixed_workload(vocab))[0]


@pytest.mark.parametrize(("arch", "tp", "broadcast"), [
    ("qwen2", 2, "async"), ("qwen2", 2, "sync"), ("llama", 4, "async")])
def test_engine_greedy_equals_unsplit(tmp_path: Path, arch: str, tp: int, broadcast: str) -> None:
    path = _tiny(tmp_path, arch)
    loaded = load_weights(path)
    # A pool far smaller than the workload's demand and a small token budget force chunked
    # prefill, prefix hits and preemption all in one run (as in test_engine_vs_reference).
    kw = dict(num_kv_blocks=20, max_num_seqs=6, max_num_batched_tokens=12, tp_broadcast=broadcast)
    cfg1 = _cfg(**kw)
    want_engine = LLMEngine(TorchRunner(loaded.arch, loaded.tensors, cfg1), cfg1, eos_token_ids=[0])
    want = _drive(want_engine)
    cfg2 = _cfg(tensor_parallel_size=tp, **kw)
    with _tp_runner(path, cfg2) as runner:
        engine = LLMEngine(runner, cfg2, eos_token_ids=[0])
        got = _drive(engine)
        stats = engine.stats()
        assert stats.num_preemptions_total > 0
        assert stats.prefix_cache_hit_tokens_total > 0
        assert stats.kv_blocks_used == 0
        assert runner._handles == {}, "every finished or aborted request is forgotten"
    assert got == want


def test_smollm2_tp3_engine_greedy_equals_unsplit(smollm2_path: Path) -> None:
    loaded = load_weights(smollm2_path)
    kw = dict(num_kv_blocks=20, max_num_seqs=6, max_num_batched_tokens=12)
    cfg1 = _cfg(**kw)
    want = _drive(LLMEngine(TorchRunner(loaded.arch, loaded.tensors, cfg1), cfg1, eos_token_ids=[0]),
                  loaded.arch.vocab_size)
    cfg3 = _cfg(tensor_parallel_size=3, **kw)
    with _tp_runner(smollm2_path, cfg3) as runner:
        engine = LLMEngine(runner, cfg3, eos_token_ids=[0])
        got = _drive(engine, loaded.arch.vocab_size)
        stats = engine.stats()
        assert stats.num_preemptions_total > 0 and stats.prefix_cache_hit_tokens_total > 0
    assert got == want


def test_kv_export_import_keeps_whole_model_layout(tmp_path: Path) -> None:
    path = _tiny(tmp_path, "llama")
    loaded = load_weights(path)
    single = TorchRunner(loaded.arch, loaded.tensors, _cfg())
    _logits(single, _with_owners(_batches(128)[:1]))
    want = single.export_kv([0, 1, 4, 5])
    with _tp_runner(path, _cfg(tensor_parallel_size=2)) as runner:
        _logits(runner, _with_owners(_batches(128)[:1]))
        got = runner.export_kv([0, 1, 4, 5])
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        # Import the unsplit KV into other blocks; exporting them back returns it unchanged.
        runner.import_kv([9, 10, 11, 12], want)
        torch.testing.assert_close(runner.export_kv([9, 10, 11, 12]), want, atol=0, rtol=0)


def test_layout_that_cannot_split_is_refused() -> None:
    arch = ModelArchConfig(architecture="llama", vocab_size=8, hidden_size=36, intermediate_size=96,
                           num_layers=1, num_heads=9, num_kv_heads=3, head_dim=4, rope_theta=1e4,
                           rms_norm_eps=1e-6, max_position_embeddings=8, tie_word_embeddings=False,
                           attention_bias=False)
    check_tp_layout(arch, 3)
    with pytest.raises(ValueError, match="9 attention heads.*3 KV heads"):
        check_tp_layout(arch, 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_nccl_group_is_built_and_all_reduces_on_cuda() -> None:
    # One GPU: a group of one, through the same init and all-reduce the TP forward uses.
    from services.engine.parallel import comm
    from services.engine.tp.runner import _free_port

    comm.init_group(0, 1, _free_port(), torch.device("cuda"), timeout_s=60)
    try:
        assert torch.distributed.get_backend() == "nccl"
        t = torch.ones(4, device="cuda")
        calls = comm.ALL_REDUCE.calls
        comm.all_reduce(t)
        assert comm.ALL_REDUCE.calls == calls + 1
        assert t.cpu().tolist() == [1.0] * 4
    finally:
        comm.destroy_group()
