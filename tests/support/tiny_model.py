"""Tiny random Hugging Face models and helpers shared by the engine compute tests."""

from __future__ import annotations

import torch

from services.api.sampling import SamplingParams
from services.common.config import EngineConfig
from services.engine.batch import ScheduledBatch, ScheduledSeq
from services.engine.engine import LLMEngine
from services.engine.request import GenerateRequest
from services.engine.runner.torch_runner import TorchRunner
from services.model.arch import ModelArchConfig

GREEDY = SamplingParams(temperature=0.0)


def tiny_hf_model(architecture: str = "llama", tie: bool = False, seed: int = 0):
    """A tiny random LlamaForCausalLM / Qwen2ForCausalLM (float32, eval) and its ModelArchConfig."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    common = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=tie,
        # Larger than the default 0.02 so attention is far from uniform and a wrong
        # position, mask or cache slot moves the logits well past the tolerance.
        initializer_range=0.15,
    )
    if architecture == "llama":
        cfg, cls = LlamaConfig(**common), LlamaForCausalLM
    else:
        cfg, cls = Qwen2Config(**common), Qwen2ForCausalLM
    model = cls(cfg).float().eval()
    if architecture == "qwen2":
        # Random init leaves q/k/v biases at zero; make them matter.
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    arch = ModelArchConfig(
        architecture=architecture,
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
        attention_bias=architecture == "qwen2",
    )
    return model, arch


def make_runner(arch: ModelArchConfig, tensors: dict[str, torch.Tensor], **cfg) -> TorchRunner:
    defaults = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=64)
    defaults.update(cfg)
    return TorchRunner(arch, tensors, EngineConfig(**defaults))


def seq(
    rid: str,
    tokens: list[int],
    start: int,
    blocks: list[int],
    sample: bool = True,
    sampling: SamplingParams = GREEDY,
    num_generated: int = 0,
) -> ScheduledSeq:
    return ScheduledSeq(rid, list(tokens), start, list(blocks), sample, sampling, num_generated)


def batch(*seqs: ScheduledSeq) -> ScheduledBatch:
    return ScheduledBatch(list(seqs))


def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    """Logits (len(tokens), V) of a full causal forward pass."""
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


MIXED_ABORTED = frozenset({"r4", "r8"})


def mixed_workload(vocab: int = 128, seed: int = 1) -> list[GenerateRequest]:
    """Ten greedy requests of 4-13 tokens whose prompts share a 13-token run (a prefix, or a
    suffix for every third), with tails of 1-19 tokens: prefix hits and distinct work."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, vocab, (13,), generator=g).tolist()
    reqs = []
    for i in range(10):
        tail = torch.randint(3, vocab, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g).tolist()
        prompt = (shared + tail) if i % 3 != 2 else tail + shared
        sampling = SamplingParams(temperature=0, max_tokens=int(torch.randint(4, 14, (1,), generator=g)),
                                  ignore_eos=True)
        reqs.append(GenerateRequest(f"r{i}", prompt, sampling))
    return reqs


def drive_mixed(engine: LLMEngine, reqs: list[GenerateRequest]) -> tuple[dict[str, list[int]], dict[str, str]]:
    """Six of ``reqs`` first, the rest at step 3 while those decode, ``MIXED_ABORTED`` aborted
    at step 5; step until drained. Returns each request's tokens and finish reason."""
    got: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    finished: dict[str, str] = {}
    for r in reqs[:6]:
        engine.add_request(r)
    steps = 0
    while engine.has_unfinished() or steps < 3:
        if steps == 3:
            for r in reqs[6:]:  # a second wave arrives while the first decodes
                engine.add_request(r)
        if steps == 5:
            for rid in sorted(MIXED_ABORTED):
                engine.abort(rid)
        for out in engine.step():
            got[out.request_id].extend(out.token_ids)
            if out.finished:
                finished[out.request_id] = out.finish_reason.value
        steps += 1
        assert steps < 2000, "engine did not drain"
    return got, finished
