"""The paged, batched, chunked engine produces exactly the greedy tokens of a naive
full-recompute reference (Hugging Face transformers on the same tiny random weights),
across mixed batches with prefix hits, chunked prefill, preemption and aborts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.common.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.runner.torch_runner import TorchRunner
from services.engine.weights import load_weights
from tests.support.tiny_model import MIXED_ABORTED, drive_mixed, mixed_workload, tiny_hf_model


def _hf_model(arch: str, out: Path):
    model, _ = tiny_hf_model(arch, tie=False, seed=7)
    model.save_pretrained(out, safe_serialization=True)  # the engine loads it from disk
    return model


@torch.inference_mode()
def _reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    toks = list(prompt)
    for _ in range(n):
        logits = model(torch.tensor([toks])).logits[0, -1]  # (V,) full recompute, no cache
        toks.append(int(logits.argmax()))
    return toks[len(prompt):]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_engine_greedy_equals_full_recompute(tmp_path: Path, arch: str) -> None:
    model = _hf_model(arch, tmp_path)
    loaded = load_weights(tmp_path)
    # Tiny blocks, a small token budget and a KV pool far smaller than the workload's
    # demand force chunked prefill, prefix hits and preemption all in one run.
    cfg = EngineConfig(device="cpu", dtype="float32", block_size=4, num_kv_blocks=20,
                       max_num_seqs=6, max_num_batched_tokens=12)
    engine = LLMEngine(TorchRunner(loaded.arch, loaded.tensors, cfg), cfg, eos_token_ids=[0])
    reqs = mixed_workload()
    expected = {r.request_id: _reference_greedy(model, r.prompt_token_ids, r.sampling.max_tokens) for r in reqs}
    got, finished = drive_mixed(engine, reqs)

    for r in reqs:
        if r.request_id in MIXED_ABORTED:
            continue
        assert finished[r.request_id] == "length"
        assert got[r.request_id] == expected[r.request_id], r.request_id
    stats = engine.stats()
    assert stats.num_preemptions_total > 0, "workload should force preemption"
    assert stats.prefix_cache_hit_tokens_total > 0, "workload should hit the prefix cache"
    assert stats.kv_blocks_used == 0
    engine.check_integrity()
