"""The paged, batched, chunked engine produces exactly the greedy tokens of a naive
full-recompute reference (Hugging Face transformers on the same tiny random weights),
across mixed batches with prefix hits, chunked prefill, preemption and aborts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.common.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.request import GenerateRequest, SamplingParams
from services.engine.runner.torch_runner import TorchRunner
from services.engine.weights import load_weights
from tests.unit._tiny_model import tiny_hf_model


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


def _workload(gen: torch.Generator) -> list[GenerateRequest]:
    shared = torch.randint(3, 128, (13,), generator=gen).tolist()
    reqs = []
    for i in range(10):
        tail = torch.randint(3, 128, (int(torch.randint(1, 20, (1,), generator=gen)),), generator=gen).tolist()
        prompt = (shared + tail) if i % 3 != 2 else tail + shared
        sampling = SamplingParams(temperature=0, max_tokens=int(torch.randint(4, 14, (1,), generator=gen)),
                                  ignore_eos=True)
        reqs.append(GenerateRequest(f"r{i}", prompt, sampling))
    return reqs


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_engine_greedy_equals_full_recompute(tmp_path: Path, arch: str) -> None:
    model = _hf_model(arch, tmp_path)
    loaded = load_weights(tmp_path)
    # Tiny blocks, a small token budget and a KV pool far smaller than the workload's
    # demand force chunked prefill, prefix hits and preemption all in one run.
    cfg = EngineConfig(device="cpu", dtype="float32", block_size=4, num_kv_blocks=20,
                       max_num_seqs=6, max_num_batched_tokens=12)
    engine = LLMEngine(TorchRunner(loaded.arch, loaded.tensors, cfg), cfg, eos_token_ids=[0])
    reqs = _workload(torch.Generator().manual_seed(1))
    expected = {r.request_id: _reference_greedy(model, r.prompt_token_ids, r.sampling.max_tokens) for r in reqs}

    got: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    finished: dict[str, str] = {}
    aborted = {"r4", "r8"}
    for r in reqs[:6]:
        engine.add_request(r)
    steps = 0
    while engine.has_unfinished() or steps < 3:
        if steps == 3:
            for r in reqs[6:]:  # a second wave arrives while the first decodes
                engine.add_request(r)
        if steps == 5:
            for rid in aborted:
                engine.abort(rid)
        for out in engine.step():
            got[out.request_id].extend(out.token_ids)
            if out.finished:
                finished[out.request_id] = out.finish_reason.value
        steps += 1
        assert steps < 2000, "engine did not drain"

    for r in reqs:
        if r.request_id in aborted:
            continue
        assert finished[r.request_id] == "length"
        assert got[r.request_id] == expected[r.request_id], r.request_id
    stats = engine.stats()
    assert stats.num_preemptions_total > 0, "workload should force preemption"
    assert stats.prefix_cache_hit_tokens_total > 0, "workload should hit the prefix cache"
    assert stats.kv_blocks_used == 0
    engine.check_integrity()
